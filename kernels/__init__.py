"""pagekv.kernels: page-first host <-> layer-first device transfers and the fused KV store.

Each operation has a torch reference (:mod:`.reference`), the oracle for the CUDA kernels and
the CPU path.
"""

from .layout import DeviceKV, Direction
from .reference import copy_slots_ref, load_ref, save_ref, store_kv_ref

__all__ = ["DeviceKV", "Direction", "copy_slots_ref", "load_ref", "save_ref", "store_kv_ref"]
