"""The connector's host <-> device transfers: their index tensors, their backend and where they
are enqueued.

The engine gives the connector slot tables on the CPU (validated there) or on its device; the
connector's page ids are host ints. For CPU tables the connector asks
:func:`pagekv.kernels.choose_backend` what ``auto`` takes for the transfer's shape: the copy
engine (batched or pitched) and the direct backend build their copies on the host, so their
indices stay CPU tensors (read during the call: no upload, no device sync, nothing to keep
alive); the kernel reads device tensors, uploaded on the current stream from the connector's
pinned ring (:class:`~.staging.IndexStaging`), which the caller keeps referenced until the
launch's event completes. A CUDA slot table (the engine's tensor) always goes to the kernel:
reading it on the host would sync.

:func:`launch` enqueues a transfer. Copy-engine (batched or pitched), split and staged transfers
go to the connector's :class:`~.copy_issuer.CopyIssuer` where the caller passes one (their host
time then lands on the issuer's thread, so the table may give them shapes whose enqueue would
hold the caller: ``deferred``; the split's kernel part uploads its indices there, on the
issuer's stream); everything else is enqueued on the current stream by the caller.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagekv.kernels import DeviceKV, choose_backend, copy_engine, transfer_layers

from .copy_issuer import CopyIssuer
from .staging import IndexStaging

__all__ = ["HOST_INDEX_BACKENDS", "Indices", "Launched", "host_ids", "launch", "transfer_indices"]

HOST_INDEX_BACKENDS = ("copy_engine", "pitched", "direct", "split", "staged")
# backends an issuer thread enqueues (their host time grows with the transfer)
ISSUED_BACKENDS = ("copy_engine", "pitched", "split", "staged")


@dataclass(frozen=True)
class Indices:
    """``ids`` ``[n]`` and ``slots`` ``[n, page_size]``, both on the CPU with ``backend`` one of
    :data:`HOST_INDEX_BACKENDS`, or both on the device with ``backend`` ``"auto"`` (the kernel,
    or what ``PAGEKV_COPY_BACKEND`` says). Pass all three to ``load``/``save``."""

    ids: torch.Tensor
    slots: torch.Tensor
    backend: str

    @property
    def on_device(self) -> bool:
        return self.ids.is_cuda


def host_ids(values: Sequence[int]) -> torch.Tensor:
    """``values`` (host ints: page ids, rows) as a CPU int64 tensor, converted in C by
    ``array.array``: 3-3.5x faster than ``torch.tensor`` on a list (a 4 GiB prefix of TP-8
    pages is 16k ids: 0.6 ms of the engine's thread against 2.1 ms, 2-core dev machine).
    Raises as ``array`` does for a value that is not an int or does not fit in 64 bits."""
    if not len(values):
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def transfer_indices(
    load: bool,
    kv: DeviceKV,
    page_ids: list[int],
    slots: torch.Tensor,
    staging: IndexStaging,
    *,
    layer: int | None = None,
    deferred: bool = False,
) -> Indices:
    """Indices for a transfer of ``page_ids`` to/from ``slots`` (validated CPU table, or the
    engine's CUDA tensor), launched next on the current stream (uploads go there), or by an
    issuer thread where ``deferred`` (see :func:`pagekv.kernels.choose_backend`)."""
    ids = host_ids(page_ids)
    if not slots.is_cuda:
        choice = choose_backend(load, kv, ids, slots, layer=layer, deferred=deferred)
        if choice in HOST_INDEX_BACKENDS:
            return Indices(ids, slots.contiguous(), choice)
        slots = staging.upload(slots, kv.device)
    return Indices(staging.upload(ids, kv.device), slots, "auto")


@dataclass(frozen=True)
class Launched:
    """What :func:`launch` enqueued: the backend (``copy_engine``, ``pitched``, ``split`` or
    ``staged`` when queued on the issuer), one completion per layer asked for (a
    ``torch.cuda.Event`` recorded on the current stream, or the issuer's
    :class:`~.copy_issuer.Completion`), and the indices, which the caller keeps referenced until
    the last completion has completed."""

    backend: str
    events: list[Any]
    indices: Indices


def launch(
    load_: bool,
    kv: DeviceKV,
    host: torch.Tensor,
    page_ids: list[int],
    slots: torch.Tensor,
    staging: IndexStaging,
    issuer: CopyIssuer | None,
    *,
    layers: Sequence[int | None] = (None,),
) -> Launched:
    """Enqueue the transfer of ``page_ids`` (host pages) to (``load_``) or from the device
    ``slots``, after the current stream's enqueued work: once per entry of ``layers`` (None:
    all layers at once; else those layers, one after the other), one completion each. With an
    ``issuer``, a transfer the table gives a backend of ``ISSUED_BACKENDS`` is queued there and
    the current stream is not ordered after it: consumers wait on the completions. (Where the
    device has no batched copies, or has stopped using them, the issuer is not used: the choice
    is the caller's thread's, and runs here.)"""
    deferred = issuer is not None and copy_engine.supported(kv.device.index or 0)
    idx = transfer_indices(load_, kv, page_ids, slots, staging, layer=layers[0],
                           deferred=deferred)  # fmt: skip
    job = functools.partial(transfer_layers, load_, host, idx.ids, kv, idx.slots, list(layers),
                            backend=idx.backend)  # fmt: skip
    if idx.backend in ISSUED_BACKENDS and deferred:
        return Launched(idx.backend, issuer.submit(job, len(layers)), idx)
    backend, events = job()
    return Launched(backend, events, idx)
