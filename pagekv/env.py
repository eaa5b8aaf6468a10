"""Every process-wide ``PAGEKV_*`` environment variable, typed, in one registry.

Each variable is an :class:`EnvVar`: its name, its kind (the one parser its text goes through),
its default and what it does. Code reads a variable only through its entry
(``env.NATIVE_COPY.get()``), on each call, so a test or an operator that changes the environment
is seen at once. A value that does not parse raises :class:`~pagekv.errors.ConfigError` naming
the variable; unset or blank is the default. The README's table is generated from
:data:`REGISTRY` (``python -m pagekv.env``; tests/test_env.py fails when it is out of date).

The settings of ``pagekv serve`` and ``pagekv cluster`` are a second family: each is also
``PAGEKV_<SETTING>`` (``PAGEKV_CAPACITY=8GiB``), read by :mod:`pagekv.store.cli.settings` with
the same parsers, and listed by ``pagekv serve --help``.

Sizes follow GNU coreutils: ``K``/``M``/``G``/``T`` and ``KiB``/``MiB``/``GiB``/``TiB`` are
powers of 1024, ``KB``/``MB``/``GB``/``TB`` powers of 1000, a bare number is bytes.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from .errors import ConfigError

__all__ = [
    "BULK_CLIENT",
    "CACHE_DIR",
    "CONFIG",
    "COPY_BACKEND",
    "ENGINE_VENVS",
    "EXIT_FLUSH_S",
    "KERNELS",
    "MALLOC_TOP_PAD",
    "NATIVE_COPY",
    "OFFLINE",
    "REGISTRY",
    "REQUIRE_MOONCAKE",
    "REQUIRE_SGLANG",
    "REQUIRE_VLLM",
    "SHM_CLIENT",
    "TUNE_MALLOC",
    "EnvVar",
    "markdown",
    "parse_bool",
    "parse_float",
    "parse_int",
    "parse_size",
]

T = TypeVar("T")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6}
_UNITS.update({"mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40})
_UNITS.update({"tb": 10**12, "tib": 1 << 40})


def parse_size(text: str | int) -> int:
    """Bytes from "4GiB", "512M", "1.5gb" or an int. Raises ``ValueError`` naming the input."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"not a size: {text!r} (sizes are >= 0)")
        return text
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_bool(value: Any) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case), or a bool."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r} (true/false, 1/0, yes/no, on/off)")


def parse_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"not an integer: {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"not an integer: {value!r}") from None


def parse_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"not a number: {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"not a number: {value!r}") from None


def _choice(*allowed: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in allowed:
            raise ValueError(f"one of {', '.join(allowed)}, got {value!r}")
        return text

    parse.__name__ = "|".join(allowed)
    return parse


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: ``PAGEKV_<name>``, parsed by ``parse``, ``default`` when unset
    or blank. ``kind`` and ``shown_default`` are what the docs say; ``reader`` names who reads
    it when that is not pagekv's Python code (a shell script, the test harness)."""

    name: str
    parse: Callable[[Any], T]
    default: T
    doc: str
    kind: str
    shown_default: str = ""
    reader: str = ""

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text, None when unset or blank."""
        text = (os.environ if environ is None else environ).get(self.name)
        return None if text is None or not text.strip() else text

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The variable's value now. Raises ``ConfigError`` naming it for text that does not
        parse."""
        text = self.raw(environ)
        if text is None:
            return self.default
        try:
            return self.parse(text)
        except ValueError as e:
            raise ConfigError(f"${self.name}: {e}") from None


def _var(name: str, parse: Callable[[Any], T], default: T, doc: str, kind: str,
         shown: str = "", reader: str = "") -> EnvVar[T]:  # fmt: skip
    return EnvVar(f"PAGEKV_{name}", parse, default, doc, kind, shown or str(default), reader)


_CACHE = Path.home() / ".cache" / "pagekv"

# ---- the registry, in the order the README lists it ---------------------------------------------
KERNELS = _var("KERNELS", _choice("auto", "torch", "cuda"), "auto",
               "GPU transfer kernels: `auto` (CUDA kernels when nvcc and a GPU are there, else the "
               "torch reference with one warning), `torch` (always the reference), `cuda` (the "
               "kernels or an error saying why)", "auto, torch, cuda")  # fmt: skip
COPY_BACKEND = _var("COPY_BACKEND", _choice("auto", "kernel", "copy_engine", "pitched", "direct",
                                             "split", "staged", "torch"),
                    "auto", "what GPU transfers with `backend=\"auto\"` use: `auto` (per transfer "
                    "shape, from a table measured once per GPU and cached: the faster DMA "
                    "backend, which takes no SMs (the copy engine for runs of at least 64 KiB, "
                    "the pitched copy for all layers), where it is within 10% of the fastest "
                    "(for the connector's issuer thread, whose transfers run beside the engine's "
                    "compute: within 50%, the copy engine from 32 KiB; failing that the split "
                    "where it is within 50%), else the fastest; a "
                    "backend whose host time per call exceeds the kernel's only where the "
                    "connector's issuer thread enqueues it, never on the caller's thread; the "
                    "kernel for CUDA index tensors and graph capture), or one of `kernel`, "
                    "`copy_engine` (the kernel where the driver lacks batched copies), `pitched` "
                    "(all layers as one 2-D copy per run of slots and K/V, where each K/V's "
                    "layers lie at one distance; else the kernel), `direct`, `split` (all "
                    "layers shared between the kernel on 2 thread blocks and the pitched copy "
                    "beside it, each share from the measured table; where the pitched copy "
                    "suits, else the kernel), "
                    "`staged` (all-layer transfers as whole-page copies through a device buffer, "
                    "the kernel for one layer: 0.96-0.97 of the bus for loads of runs under 64 "
                    "KiB from 1 GiB, where the kernel moves 0.92, and it costs a decode beside "
                    "it 1.7-2.3x a plain copy's slowdown; "
                    "never taken by `auto`), `torch` for every transfer",
                    "auto, kernel, copy_engine, pitched, direct, split, staged, torch")  # fmt: skip
NATIVE_COPY = _var("NATIVE_COPY", _choice("auto", "on", "off"), "auto",
                   "the native checked copy and receive (C, built with `$CC` on first use): "
                   "`auto` (when it builds, else numpy with one warning; clients then use no "
                   "bulk lane), `on` (it or an error saying why), `off`",
                   "auto, on, off")  # fmt: skip
CACHE_DIR = _var("CACHE_DIR", Path, _CACHE,
                 "where the CUDA kernels and the native library are built and cached",
                 "path", "~/.cache/pagekv")  # fmt: skip
BULK_CLIENT = _var("BULK_CLIENT", parse_bool, True,
                   "default of `ClientConfig.bulk`: PUTs and GETs of a node that offers a bulk "
                   "lane go over it, where the native library is (off: ZeroMQ only)", "bool",
                   "on")  # fmt: skip
SHM_CLIENT = _var("SHM_CLIENT", parse_bool, True,
                  "default of `ClientConfig.shm`: GETs of `--shm` nodes on this host are read "
                  "straight out of their segment (off: over TCP)",
                  "bool", "on")  # fmt: skip
EXIT_FLUSH_S = _var("EXIT_FLUSH_S", parse_float, 10.0,
                    "seconds a process that exits without `KVConnector.close()` spends flushing "
                    "its pending write-back", "seconds", "10")  # fmt: skip
CONFIG = _var("CONFIG", str, None,
              "TOML file of `pagekv serve`/`cluster` settings (as `--config`)", "path",
              "unset")  # fmt: skip
TUNE_MALLOC = _var("TUNE_MALLOC", parse_bool, True,
                   "nodes: keep blocks in one untrimmed glibc heap, warmed up to the capacity at "
                   "start (`pagekv.store.node.memory`)",
                   "bool", "on")  # fmt: skip
MALLOC_TOP_PAD = _var("MALLOC_TOP_PAD", parse_size, 64 << 20,
                      "nodes with `PAGEKV_TUNE_MALLOC`: glibc top pad (bytes kept when a heap "
                      "shrinks)", "size", "64MiB")  # fmt: skip
ENGINE_VENVS = _var("ENGINE_VENVS", str, str(_CACHE / "venvs"),
                    "where `make test-vllm` / `make test-sglang` build the engines' venvs",
                    "path", "~/.cache/pagekv/venvs", "scripts/engines/setup_*.sh")  # fmt: skip
REQUIRE_VLLM = _var("REQUIRE_VLLM", parse_bool, False,
                    "a vLLM that cannot be imported fails tests/engines instead of skipping them "
                    "(set by `make test-vllm`)", "bool", "off", "tests/engines")  # fmt: skip
OFFLINE = _var("OFFLINE", parse_bool, False,
               "there is no package index: tests that install from it skip, saying so (set by "
               "`scripts/gpu_check.sh`)", "bool", "off", "tests")  # fmt: skip
REQUIRE_SGLANG = _var("REQUIRE_SGLANG", parse_bool, False,
                      "the same for SGLang (set by `make test-sglang`)", "bool", "off",
                      "tests/engines")  # fmt: skip

REQUIRE_MOONCAKE = _var("REQUIRE_MOONCAKE", parse_bool, False,
                        "the same for Mooncake Store: its backend's tests fail instead of "
                        "skipping (set by `make test-mooncake`, `test-vllm`, `test-sglang`)",
                        "bool", "off", "tests")  # fmt: skip

REGISTRY: tuple[EnvVar[Any], ...] = (KERNELS, COPY_BACKEND, NATIVE_COPY, CACHE_DIR, BULK_CLIENT,
                                     SHM_CLIENT, EXIT_FLUSH_S, CONFIG, TUNE_MALLOC,
                                     MALLOC_TOP_PAD, ENGINE_VENVS, REQUIRE_VLLM,
                                     REQUIRE_SGLANG, REQUIRE_MOONCAKE, OFFLINE)  # fmt: skip


def markdown() -> str:
    """The README's table of :data:`REGISTRY`."""
    rows = ["| variable | values | default | what it does |", "|---|---|---|---|"]
    for var in REGISTRY:
        doc = var.doc + (f" (read by {var.reader})" if var.reader else "")
        rows.append(f"| `{var.name}` | {var.kind} | {var.shown_default} | {doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover - `python -m pagekv.env`: the README's table
    sys.stdout.write(markdown())
