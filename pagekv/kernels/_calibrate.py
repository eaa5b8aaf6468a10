"""Timing the transfer backends on this GPU for :mod:`.copy_table` (one grid, ~30 s).

Each grid shape is a real transfer (:func:`~pagekv.kernels.load` / :func:`~pagekv.kernels.save`
as ``ops`` runs them, with the split save's share given: the table is not there yet) with CPU
page ids and slots (what ``auto`` is asked to decide), on random bytes, pages in random order
on shuffled page-sized runs of slots, on a stream of its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from pagekv.geometry import KVGeometry

from . import copy_engine, ops
from .copy_table import (
    BACKENDS,
    DIRECT_MAX_COPIES,
    TOTAL_BYTES,
    Entry,
    Shape,
    grid,
    median_seconds,
    split_shares,
)
from .layout import DeviceKV

__all__ = ["measure_entries"]


def _geometry(all_layers: bool, run: int) -> KVGeometry:
    """The standard geometry with ``run``-byte page runs: MLA-576 (1152-byte rows) where the run
    is a multiple of 1152, else 256-byte rows (TP-8 slices) up to 8 KiB, else 2 KiB rows."""
    layers = 32 if all_layers else 2
    if run % 1152 == 0:
        return KVGeometry(layers, run // 1152, 1, 576, "bf16", "mla")
    heads = 1 if run <= 8192 else 8
    return KVGeometry(layers, run // (heads * 256), heads, 128, "bf16")


def _shape_seconds(
    load: bool, all_layers: bool, run: int, total: int, host_raw: torch.Tensor, ce_ok: bool
) -> Entry:
    dev = torch.cuda.current_stream().device
    geo = _geometry(all_layers, run)
    per_page = geo.page_bytes if all_layers else geo.page_bytes // geo.num_layers
    n_pages = max(1, total // per_page)
    host = host_raw[: n_pages * geo.page_bytes].view(geo.dtype).view(n_pages, *geo.host_page_shape)
    shape = (geo.num_layers, n_pages * geo.page_size, *geo.device_layer_shape)
    caches = [torch.empty(shape, dtype=geo.dtype, device=dev) for _ in range(geo.num_kv)]
    for c in caches:
        c.view(torch.uint8).random_()
    kv = DeviceKV.from_caches(geo, *caches)
    slots = torch.randperm(n_pages)[:, None] * geo.page_size + torch.arange(geo.page_size)
    ids = torch.randperm(n_pages)
    layer = None if all_layers else 1
    rows = geo.num_layers * geo.num_kv if all_layers else geo.num_kv
    stream = torch.cuda.current_stream()
    seconds, enqueue = [], []
    shape = Shape(load, all_layers, float(run), n_pages * per_page)
    split_share = 0.0
    for backend in BACKENDS:
        t, host_s, share = math.inf, math.inf, 0.0
        for candidate in _shares(backend, seconds, load, all_layers, ce_ok, n_pages * rows):
            fn = functools.partial(ops._page_transfer, load, host, ids, kv, slots, layer, backend,
                                   None, False, candidate)  # fmt: skip
            c_t, c_host, took = _timed(fn, stream.synchronize)
            if took == {backend} and c_t < t:  # else the kernel ran (refused, or no page)
                t, host_s, share = c_t, c_host, candidate
        seconds.append((backend, t))
        enqueue.append((backend, host_s))
        if backend == "split":
            split_share = share
    return Entry(shape, tuple(seconds), tuple(enqueue), split_share)


def _shares(
    backend: str,
    seconds: list[tuple[str, float]],
    load: bool,
    all_layers: bool,
    ce_ok: bool,
    copies: int,
) -> tuple[float, ...]:
    """The copy engine's shares to time ``backend`` at (0 for all but the split save, which
    only all-layer saves take); none where it is not timed."""
    if backend == "split":
        return split_shares(seconds) if ce_ok and not load and all_layers else ()
    if (backend == "copy_engine" and not ce_ok) or (
        backend == "direct" and copies > DIRECT_MAX_COPIES
    ):
        return ()
    return (0.0,)


def _timed(fn: Callable[[], str], sync: Callable[[], None]) -> tuple[float, float, set[str]]:
    """:func:`~.copy_table.median_seconds` of ``fn`` and the backends its calls reported."""
    took: set[str] = set()
    t, host_s = median_seconds(lambda: took.add(fn()), sync)
    return t, host_s, took


def measure_entries(device: int) -> list[Entry]:
    """One :class:`Entry` per grid shape, measured on ``device`` on a stream of its own."""
    dev = torch.device("cuda", device)
    host_raw = torch.empty(2 * max(TOTAL_BYTES), dtype=torch.uint8, pin_memory=True)
    host_raw.random_()
    ce_ok = copy_engine.supported(device)
    with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev)):
        return [_shape_seconds(*shape, host_raw, ce_ok) for shape in grid()]
