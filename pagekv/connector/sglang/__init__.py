"""pagekv as SGLang's HiCache L3 storage (``--hicache-storage-backend dynamic``, module
``pagekv.connector.sglang``, class ``PagekvStorage``). Importing this package needs SGLang;
see :mod:`.storage` for the launch line and :mod:`.config` for the extra-config keys."""

from .config import SGLangBackendConfig
from .storage import PagekvStorage

__all__ = ["PagekvStorage", "SGLangBackendConfig"]
