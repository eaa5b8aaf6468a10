"""The index tensors the connector hands to a host <-> device transfer, and the backend.

The engine gives the connector slot tables on the CPU (validated there) or on its device; the
connector's page ids are host ints. For CPU tables the connector asks
:func:`pagekv.kernels.choose_backend` what ``auto`` takes for the transfer's shape: the copy
engine and the direct backend build their copies on the host, so their indices stay CPU
tensors (read during the call: no upload, no device sync, nothing to keep alive); the kernel
reads device tensors, uploaded on the current stream from the connector's pinned ring
(:class:`~.staging.IndexStaging`), which the caller keeps referenced until the launch's event
completes. A CUDA slot table (the engine's tensor) always goes to the kernel: reading it on
the host would sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagekv.kernels import DeviceKV, choose_backend

from .staging import IndexStaging

__all__ = ["HOST_INDEX_BACKENDS", "Indices", "transfer_indices"]

HOST_INDEX_BACKENDS = ("copy_engine", "direct")


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


def transfer_indices(
    load: bool,
    kv: DeviceKV,
    page_ids: list[int],
    slots: torch.Tensor,
    staging: IndexStaging,
    *,
    layer: int | None = None,
) -> Indices:
    """Indices for a transfer of ``page_ids`` to/from ``slots`` (validated CPU table, or the
    engine's CUDA tensor), launched next on the current stream (uploads go there)."""
    ids = torch.tensor(page_ids, dtype=torch.int64)
    if not slots.is_cuda:
        choice = choose_backend(load, kv, ids, slots, layer=layer)
        if choice in HOST_INDEX_BACKENDS:
            return Indices(ids, slots.contiguous(), choice)
        slots = staging.upload(slots, kv.device)
    return Indices(staging.upload(ids, kv.device), slots, "auto")
