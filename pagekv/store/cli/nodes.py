"""``pagekv stats`` and ``pagekv ping``: what each node says, or why it says nothing.

A node that does not answer is probed (:func:`probe.probe`) so the output tells "unreachable"
from "authentication failed" (with the likely cause). Exit status 1 when any node failed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..client.probe import Outcome, ProbeResult, probe
from ..config import CurveClientKeys
from ..node.auth import load_client_keys
from .settings import Setting, format_size

__all__ = ["client_settings", "run_ping", "run_stats"]

_COLUMNS = ("blocks", "bytes", "capacity", "hits", "misses", "evictions", "bytes_in", "bytes_out")
# shown when a node has a disk tier: its blocks, their bytes, hits, capacity, on/off
_DISK_COLUMNS = ("disk_blocks", "disk_bytes", "disk_hits", "disk_capacity", "disk_on")
_SIZES = {"bytes", "capacity", "bytes_in", "bytes_out", "disk_bytes", "disk_capacity"}


def client_settings() -> list[Setting]:
    return [
        Setting("timeout", 2.0, "seconds to wait for each node", "float"),
        Setting(
            "curve_server_cert", None, "CurveZMQ: the node's public certificate (NAME.key)", "path"
        ),
        Setting(
            "curve_client_cert",
            None,
            "CurveZMQ: this client's secret certificate (NAME.key_secret)",
            "path",
        ),
    ]


def _keys(values: dict[str, Any]) -> CurveClientKeys | None:
    return load_client_keys(values["curve_server_cert"], values["curve_client_cert"])


def _fetch_stats(endpoint: str, curve: CurveClientKeys | None, timeout: float) -> dict:
    """``{"endpoint", "ok": True, "stats"}`` or ``{"endpoint", "ok": False, "error", "reason"}``:
    the node is probed first, so a silent one costs one timeout and says why."""
    from ..client.blocking import StoreClient
    from ..client.routing import StoreUnavailable

    why = probe(endpoint, curve=curve, timeout_s=timeout)
    if why.outcome is Outcome.OK:
        with StoreClient(endpoint, timeout_s=timeout, curve=curve) as client:
            try:
                return {"endpoint": endpoint, "ok": True, "stats": client.stats()[0]}
            except StoreUnavailable:
                why = ProbeResult(endpoint, Outcome.NO_ANSWER, "answered PING but not STATS")
    return {"endpoint": endpoint, "ok": False, "error": why.outcome.value, "reason": why.detail}


def _cell(column: str, value: Any) -> str:
    if column in _SIZES and isinstance(value, int):
        return format_size(value)
    return str(value)


def run_stats(values: dict[str, Any], addresses: list[str], as_json: bool) -> int:
    curve = _keys(values)
    rows = [_fetch_stats(ep, curve, values["timeout"]) for ep in addresses]
    if as_json:
        json.dump({"nodes": rows}, sys.stdout, indent=2)
        print()
        return 0 if all(r["ok"] for r in rows) else 1
    width = max(32, *(len(ep) + 1 for ep in addresses))
    columns = _COLUMNS
    if any(r["ok"] and "disk_on" in r["stats"] for r in rows):
        columns += _DISK_COLUMNS
    print(f"{'node':{width}s}" + " ".join(f"{c:>13s}" if c.startswith("disk") else f"{c:>10s}"
                                          for c in columns))  # fmt: skip
    for row in rows:
        if row["ok"]:
            stats = row["stats"]
            cells = " ".join(f"{_cell(c, stats.get(c, '-')):>13s}" if c.startswith("disk")
                             else f"{_cell(c, stats.get(c, 0)):>10s}" for c in columns)  # fmt: skip
        else:
            cells = f"{row['error']}: {row['reason']}" if row["reason"] else row["error"]
        print(f"{row['endpoint']:{width}s}{cells}")
    return 0 if all(r["ok"] for r in rows) else 1


def _ping_times(endpoint: str, curve: CurveClientKeys | None, timeout: float, count: int):
    """Round trips (ms) of ``count`` PINGs on one connection; None where one got no answer."""
    import time

    from ..client.blocking import StoreClient

    times: list[float | None] = []
    with StoreClient(endpoint, timeout_s=timeout, curve=curve) as client:
        for _ in range(count):
            start = time.perf_counter()
            ok = client.ping()[0]
            times.append((time.perf_counter() - start) * 1e3 if ok else None)
    return times


def run_ping(values: dict[str, Any], addresses: list[str], count: int) -> int:
    """Probe each node (says why one is silent), then time ``count`` PINGs on a connection."""
    curve, failed = _keys(values), 0
    for ep in addresses:
        first = probe(ep, curve=curve, timeout_s=values["timeout"])
        times = _ping_times(ep, curve, values["timeout"], count) if first else []
        if not first or None in times:
            failed += 1
            print(f"{ep} {first if not first else 'no answer to a later PING'}")
            continue
        ms = sorted(times)
        print(f"{ep} ok {ms[len(ms) // 2]:.2f} ms" + (
            f" (median of {count}; min {ms[0]:.2f}, max {ms[-1]:.2f})" if count > 1 else ""
        ))  # fmt: skip
    return 1 if failed else 0
