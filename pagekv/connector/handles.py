"""What the connector hands back to an engine: a prefetched prefix and a save in flight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Prefetch", "SaveHandle"]


@dataclass
class Prefetch:
    """Pages of a prefix held in the host pool until :meth:`KVConnector.release`.

    ``num_tokens`` (a multiple of the page size) is what is ready to load: the leading
    ``len(page_ids)`` pages of ``keys``. ``loads`` are the completion events of the copies that
    read the pages (``load``/``load_async``); a release waits for them before the pages can be
    evicted or refilled.
    """

    keys: list[bytes]
    page_ids: list[int]
    page_size: int
    released: bool = False
    fetched: int = 0  # pages that came from the store (the rest were in the host tier)
    loads: list[Any] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.page_ids) * self.page_size

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)


@dataclass
class SaveHandle:
    """A save: ``pages`` newly saved, and ``event`` (CUDA, or None when the copy was
    synchronous) that completes once the device slots have been read into host pages.

    By default :meth:`KVConnector.save` has already made the engine's current stream wait on
    ``event`` (the slots may be overwritten right away); an engine that orders its own streams
    (``engine_waits=False``) waits on it itself, e.g. in vLLM's ``wait_for_save``.
    """

    pages: int
    event: Any = None

    def done(self) -> bool:
        """Whether the device -> host copy has completed (no host sync)."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Block the calling thread until the device -> host copy has completed."""
        if self.event is not None:
            self.event.synchronize()
