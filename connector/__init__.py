"""pagekv.connector: KV geometry, prefix page keys, the page-first host pool and its cache tier."""

from .geometry import SUPPORTED_DTYPES, KVGeometry, KVKind, dtype_from_name
from .hashing import KEY_BYTES, KeyNamespace, page_keys, tokens_to_bytes
from .host_pool import HostPagePool, InvalidPageError, PoolExhausted
from .page_cache import PageCache

__all__ = [
    "KEY_BYTES",
    "SUPPORTED_DTYPES",
    "HostPagePool",
    "InvalidPageError",
    "KVGeometry",
    "KVKind",
    "KeyNamespace",
    "PageCache",
    "PoolExhausted",
    "dtype_from_name",
    "page_keys",
    "tokens_to_bytes",
]
