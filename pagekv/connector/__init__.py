"""pagekv.connector: prefix page keys, the page-first host pool and its cache tier, the
scheduler-side :class:`KVIndex` and the worker-side :class:`KVConnector` that engines plug in."""

import pagekv._torch  # noqa: F401  (first: a clear ImportError when torch is missing)
from pagekv.errors import InvalidPageError, PoolExhausted
from pagekv.geometry import SUPPORTED_DTYPES, KVGeometry, KVKind, dtype_from_name

from .handles import Prefetch, SaveHandle
from .hashing import KEY_BYTES, KeyNamespace, page_keys, tokens_to_bytes
from .host_pool import HostPagePool
from .index import KVIndex
from .kv_connector import KVConnector
from .layerwise import LayerLoad
from .page_cache import PageCache

__all__ = [
    "KEY_BYTES",
    "SUPPORTED_DTYPES",
    "HostPagePool",
    "InvalidPageError",
    "KVConnector",
    "KVGeometry",
    "KVIndex",
    "KVKind",
    "KeyNamespace",
    "LayerLoad",
    "PageCache",
    "PoolExhausted",
    "Prefetch",
    "SaveHandle",
    "dtype_from_name",
    "page_keys",
    "tokens_to_bytes",
]
