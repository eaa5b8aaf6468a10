"""KV geometry: what one engine rank's KV cache looks like, and the page-first block it maps to.

Two forms (`KVKind`):

* MHA / GQA: per layer a K and a V cache, one row of ``num_kv_heads * head_dim`` elements per
  token each. Host page block: ``[num_layers, 2, page_size, num_kv_heads, head_dim]``.
* MLA: per layer one latent vector of ``head_dim`` elements per token (e.g. 576), no V, and
  ``num_kv_heads == 1``. Host page block: ``[num_layers, page_size, head_dim]``.

Throughout pagekv an *item* is one token's row of one layer of one of K, V or the latent:
``item_bytes = num_kv_heads * head_dim * element_size``.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import xxhash

from pagekv._torch import torch

__all__ = ["KVGeometry", "KVKind", "SUPPORTED_DTYPES", "dtype_from_name"]


class KVKind(enum.Enum):
    """Which tensors a layer of the cache holds."""

    MHA = "mha"  # K and V (covers GQA/MQA: num_kv_heads < num_attention_heads)
    MLA = "mla"  # one compressed latent per token, shared by all heads (DeepSeek-style)


def _supported_dtypes() -> dict[str, torch.dtype]:
    names = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    for fp8 in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, fp8):
            names[fp8] = getattr(torch, fp8)
    return names


SUPPORTED_DTYPES: dict[str, torch.dtype] = _supported_dtypes()
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}
_ALIASES.update({"float": "float32", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"})
_ALIASES["fp8_e5m2"] = "float8_e5m2"


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype for ``name`` ("bf16", "bfloat16", "torch.bfloat16", a dtype).

    Raises ``ValueError`` naming the supported dtypes when ``name`` is not one of them.
    """
    if isinstance(name, torch.dtype):
        if name in SUPPORTED_DTYPES.values():
            return name
        raise ValueError(f"dtype {name} is not supported; use one of {sorted(SUPPORTED_DTYPES)}")
    if not isinstance(name, str):
        raise TypeError(f"dtype must be a torch.dtype or a name, got {type(name).__name__}")
    key = name.removeprefix("torch.").lower()
    key = _ALIASES.get(key, key)
    if key not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[key]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_positive_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"KVGeometry.{field} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"KVGeometry.{field} must be > 0, got {value}")


@dataclass(frozen=True)
class KVGeometry:
    """One engine rank's KV cache shape. Immutable; validated on construction.

    ``dtype`` may be given as a name ("bf16") and is stored as a ``torch.dtype``. For
    ``kind=KVKind.MLA`` ``num_kv_heads`` must be 1 and ``head_dim`` is the latent width.
    Raises ``TypeError``/``ValueError`` naming the offending field.
    """

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    kind: KVKind = KVKind.MHA

    def __post_init__(self) -> None:
        for field in ("num_layers", "page_size", "num_kv_heads", "head_dim"):
            _check_positive_int(field, getattr(self, field))
        if isinstance(self.kind, str):
            try:
                object.__setattr__(self, "kind", KVKind(self.kind.lower()))
            except ValueError:
                raise ValueError(
                    f"KVGeometry.kind must be 'mha' or 'mla', got {self.kind!r}"
                ) from None
        if not isinstance(self.kind, KVKind):
            raise TypeError(f"KVGeometry.kind must be a KVKind, got {type(self.kind).__name__}")
        try:
            object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        except (TypeError, ValueError) as e:
            raise type(e)(f"KVGeometry.dtype: {e}") from None
        if self.kind is KVKind.MLA and self.num_kv_heads != 1:
            raise ValueError(
                f"KVGeometry.num_kv_heads must be 1 for MLA (one latent per token), "
                f"got {self.num_kv_heads}"
            )
        if self.item_bytes % 4 != 0:
            raise ValueError(
                f"KVGeometry.head_dim: a token row of num_kv_heads*head_dim*element_size = "
                f"{self.item_bytes} bytes must be a multiple of 4"
            )

    @classmethod
    def mla(
        cls, num_layers: int, page_size: int, latent_dim: int, dtype: torch.dtype | str = "bf16"
    ) -> KVGeometry:
        """An MLA geometry: one latent of ``latent_dim`` elements per token and layer."""
        return cls(num_layers, page_size, 1, latent_dim, dtype, KVKind.MLA)  # type: ignore[arg-type]

    # ---- derived sizes (the ones every transfer call reads are cached: the fields are frozen)
    @property
    def is_mla(self) -> bool:
        return self.kind is KVKind.MLA

    @property
    def num_kv(self) -> int:
        """Tensors per layer: 2 (K, V) for MHA, 1 (latent) for MLA."""
        return 1 if self.is_mla else 2

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def row_elems(self) -> int:
        """Elements in one token's row of one layer of K, V or latent."""
        return self.num_kv_heads * self.head_dim

    @functools.cached_property
    def item_bytes(self) -> int:
        """Bytes of one token's row of one layer of K, V or latent (the unit the kernels move)."""
        return self.row_elems * self.element_size

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.num_kv * self.item_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer

    @functools.cached_property
    def page_bytes(self) -> int:
        """Bytes of one page block: all layers, K and V (or the latent), ``page_size`` tokens."""
        return self.page_size * self.bytes_per_token

    @functools.cached_property
    def host_page_shape(self) -> tuple[int, ...]:
        """Shape of one page block in the host pool (see module docstring)."""
        if self.is_mla:
            return (self.num_layers, self.page_size, self.head_dim)
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @functools.cached_property
    def device_layer_shape(self) -> tuple[int, ...]:
        """Per-slot shape of one layer of the device cache: ``(heads, dim)`` or ``(dim,)``."""
        return (self.head_dim,) if self.is_mla else (self.num_kv_heads, self.head_dim)

    @property
    def fingerprint(self) -> str:
        """Stable 16-hex-digit id of this geometry (same in every process and version of Python).

        Used to namespace keys: blocks of different geometries never share a key.
        """
        canon = (
            f"pagekv-geometry-v1|{self.kind.value}|{self.num_layers}|{self.page_size}|"
            f"{self.num_kv_heads}|{self.head_dim}|{_dtype_name(self.dtype)}"
        )
        return xxhash.xxh3_64_hexdigest(canon.encode())

    def describe(self) -> str:
        return (
            f"{self.kind.value} L={self.num_layers} page={self.page_size} "
            f"heads={self.num_kv_heads} dim={self.head_dim} {_dtype_name(self.dtype)} "
            f"({self.page_bytes / 2**20:.2f} MiB/page)"
        )
