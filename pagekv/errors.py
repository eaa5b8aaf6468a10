"""One exception hierarchy for every pagekv package.

Every error pagekv raises on purpose derives from :class:`PagekvError`, and each also derives
from the builtin that names the kind of mistake (``ValueError`` for bad values, ``TypeError``
for wrong types, ``RuntimeError`` for a state of the world), so ``except ValueError`` keeps
working and ``except PagekvError`` catches everything pagekv signals.

=========================  ======================  =============================================
class                      builtin base            raised when
=========================  ======================  =============================================
``ConfigError``            ``ValueError``          a config or argument value is invalid
``InvalidPageError``       ``IndexError``, ``V..``  a host page id is out of range, not held, ...
``InvalidSlotError``       ``IndexError``, ``V..``  a device slot is outside the cache
``PoolExhausted``          ``RuntimeError``        the host pool cannot supply the pages asked
``KernelsUnavailable``     ``RuntimeError``        the CUDA kernels cannot run here (says why)
``NativeCopyUnavailable``  ``RuntimeError``        the native checked copy cannot be built here
``ProtocolError``          ``ValueError``          a store message is malformed (has ``code``)
``StoreError``             ``RuntimeError``        the store could not serve a request
``StoreUnavailable``       ``StoreError``          no node could be reached at all
``AuthenticationFailed``   ``StoreUnavailable``    a node refused this client's CURVE keys
``ConnectorClosed``        ``RuntimeError``        a connector was used after ``close()``
``WriteBackFailed``        ``RuntimeError``        the write-back worker died; ``flush`` says so
``CopyFailed``             ``RuntimeError``        a GPU transfer could not be enqueued
=========================  ======================  =============================================
"""

from __future__ import annotations

__all__ = [
    "AuthenticationFailed",
    "ConfigError",
    "ConnectorClosed",
    "CopyFailed",
    "InvalidPageError",
    "InvalidSlotError",
    "KernelsUnavailable",
    "NativeCopyUnavailable",
    "PagekvError",
    "PoolExhausted",
    "ProtocolError",
    "StoreError",
    "StoreUnavailable",
    "WriteBackFailed",
]


class PagekvError(Exception):
    """Base of every error pagekv raises on purpose."""


class ConfigError(PagekvError, ValueError):
    """A configuration or argument value is invalid; the message names the field."""


class InvalidPageError(PagekvError, IndexError, ValueError):
    """A host page id outside the pool, not allocated (double free), not held, or repeated
    in one call. The same type from the host pool, the page cache and the kernels."""


class InvalidSlotError(PagekvError, IndexError, ValueError):
    """A device slot index outside the engine's cache (the kernels and the connector)."""


class PoolExhausted(PagekvError, RuntimeError):
    """Fewer free (or evictable) pages than requested; nothing was allocated."""


class KernelsUnavailable(PagekvError, RuntimeError):
    """The CUDA kernels cannot be used here; the message says why and what to do."""


class NativeCopyUnavailable(PagekvError, RuntimeError):
    """The store's native checked copy (``PAGEKV_NATIVE_COPY=on``) could not be built or
    loaded; the message names the compiler, holds its output and says what to do."""


class ProtocolError(PagekvError, ValueError):
    """A malformed store message; ``code`` (a ``pagekv.store.Code``) says which kind."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class StoreError(PagekvError, RuntimeError):
    """The store could not serve a request (every replica failed or answered an error)."""


class StoreUnavailable(StoreError):
    """No node could be reached for a request that needs one (stats, ping)."""


class AuthenticationFailed(StoreUnavailable):
    """A node refused this client's CURVE credentials (not the same as a dead node)."""


class ConnectorClosed(PagekvError, RuntimeError):
    """The connector was used after :meth:`close`."""


class WriteBackFailed(PagekvError, RuntimeError):
    """The background write-back stopped on an unexpected error; the message holds it."""


class CopyFailed(PagekvError, RuntimeError):
    """A transfer queued on a connector's copy issuer could not be enqueued on the GPU: the
    bytes it was to copy are not there (see :mod:`pagekv.connector.copy_issuer`)."""
