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
    read the pages (``load``/``load_async``, the chunks of a prefetch with ``device_slots``); a
    release waits for them before the pages can be evicted or refilled.

    Prefetched with ``device_slots``: ``streaming`` (a :class:`.StreamingLoad`) has queued the
    copies of the leading ``loaded_tokens`` into those slots; the engine's stream calls
    :meth:`wait_loaded` before reading or writing the slots, whatever ``num_tokens`` is.
    """

    keys: list[bytes]
    page_ids: list[int]
    page_size: int
    released: bool = False
    fetched: int = 0  # pages that came from the store (the rest were in the host tier)
    loads: list[Any] = field(default_factory=list)
    streaming: Any = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.page_ids) * self.page_size

    @property
    def loaded_tokens(self) -> int:
        """Leading tokens whose copy into ``device_slots`` has been launched (done on CPU);
        equal to ``num_tokens`` when the prefetch got what it asked for. 0 without
        ``device_slots`` and when nothing is held (``num_tokens`` 0)."""
        if self.streaming is None:
            return 0
        return min(self.streaming.loaded, len(self.page_ids)) * self.page_size

    @property
    def loaded_event(self) -> Any:
        """Completes once every chunk launched into ``device_slots`` has landed (``wait``,
        ``query``, ``synchronize`` as a CUDA event's). None on CPU, without ``device_slots``, or
        when no chunk was launched."""
        return None if self.streaming is None else self.streaming.done_event

    def wait_loaded(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current stream) wait, on the GPU, until every chunk
        launched into ``device_slots`` has landed: no host sync. Call it before the engine
        reads or writes those slots in every case: a prefetch that came short (deadline,
        miss, ``min_tokens``) may have chunks still landing. Nothing to do on CPU."""
        if self.streaming is not None:
            self.streaming.wait(stream)

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
