"""pagekv.kernels: page-first host <-> layer-first device transfers and the fused KV store.

One function per operation (:func:`load`, :func:`save`, :func:`copy_slots`, :func:`store_kv`),
each dispatching to the CUDA kernels, the copy engines (:mod:`.copy_engine`), the direct
memcpy backend, the kernel and the pitched copy side by side (:mod:`.split`), whole pages
staged in device memory (:mod:`.staged`) or the torch reference
(:mod:`.reference`, the oracle for the kernels and the CPU path); :mod:`.copy_table` says which
one ``auto`` takes. See :mod:`.layout` for the layouts and :mod:`.jit` for how the kernels are
built and the settings (``PAGEKV_KERNELS``, ``PAGEKV_COPY_BACKEND``, ``PAGEKV_CACHE_DIR``).
"""

import pagekv._torch  # noqa: F401  (first: a clear ImportError when torch is missing)

from .copy_table import calibrate
from .fused_store import store_kv
from .jit import KernelsUnavailable, kernels_unavailable_reason
from .layout import DeviceKV
from .ops import (
    DIRECT_MIN_RUN_BYTES,
    Backend,
    choose_backend,
    copy_slots,
    load,
    save,
    transfer_layers,
)
from .reference import copy_slots_ref, load_ref, save_ref, store_kv_ref

__all__ = [
    "DIRECT_MIN_RUN_BYTES",
    "Backend",
    "DeviceKV",
    "KernelsUnavailable",
    "calibrate",
    "choose_backend",
    "copy_slots",
    "copy_slots_ref",
    "kernels_unavailable_reason",
    "load",
    "load_ref",
    "save",
    "save_ref",
    "store_kv",
    "store_kv_ref",
    "transfer_layers",
]
