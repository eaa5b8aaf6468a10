"""pagekv: a remote KV-cache store and connector for LLM serving engines.

Subpackages (data flow order): :mod:`pagekv.connector` (what an engine plugs in),
:mod:`pagekv.kernels` (host <-> GPU transfers), :mod:`pagekv.store` (store nodes and clients).
Shared by all: :mod:`pagekv.geometry` (KV shapes) and :mod:`pagekv.errors` (one exception
hierarchy). Importing ``pagekv`` itself loads neither torch nor ZeroMQ.
"""

from importlib.metadata import PackageNotFoundError, version

from .errors import PagekvError

try:
    __version__ = version("pagekv")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["PagekvError", "__version__"]
