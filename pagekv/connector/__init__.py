"""pagekv.connector: KV geometry, prefix page keys, the page-first host pool and its cache tier,
and the KVConnector that engines plug in."""

from pagekv.geometry import SUPPORTED_DTYPES, KVGeometry, KVKind, dtype_from_name

from .hashing import KEY_BYTES, KeyNamespace, page_keys, tokens_to_bytes
from .host_pool import HostPagePool, InvalidPageError, PoolExhausted
from .page_cache import PageCache

__all__ = [
    "KEY_BYTES",
    "SUPPORTED_DTYPES",
    "HostPagePool",
    "InvalidPageError",
    "KVConnector",
    "KVGeometry",
    "KVKind",
    "KeyNamespace",
    "LayerLoad",
    "PageCache",
    "PoolExhausted",
    "Prefetch",
    "dtype_from_name",
    "page_keys",
    "tokens_to_bytes",
]


def __getattr__(name: str) -> object:
    # The connector imports pagekv.kernels, which imports this package's geometry: loading
    # it lazily keeps "import pagekv.kernels" first (or alone) free of an import cycle.
    if name in ("KVConnector", "Prefetch"):
        from . import kv_connector

        return getattr(kv_connector, name)
    if name == "LayerLoad":
        from .layerwise import LayerLoad

        return LayerLoad
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
