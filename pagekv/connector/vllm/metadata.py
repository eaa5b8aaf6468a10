"""What the scheduler-side connector tells the worker ranks each step, and what each rank tells
it back. Crosses a process boundary (vLLM pickles it), so it holds only plain values: block ids
and vLLM's block hashes; each rank derives its own keys from the hashes."""

from __future__ import annotations

from dataclasses import dataclass, field

try:  # the base classes are empty markers; without vLLM (unit tests) a plain object will do
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # pragma: no cover - exercised by the tests that run without vLLM
    KVConnectorMetadata = object  # type: ignore[assignment,misc]
    KVConnectorHandshakeMetadata = object  # type: ignore[assignment,misc]
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]

__all__ = ["BlockTransfer", "PagekvHandshake", "PagekvMetadata", "PagekvWorkerMetadata",
           "SavedBlock"]  # fmt: skip


@dataclass(frozen=True)
class SavedBlock:
    """What a KV event says of a saved block beyond its hash (only with vLLM's KV events on):
    the hash of the block before it (None for the first), its tokens, the request's LoRA."""

    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to load or save: ``block_ids[i]`` holds the block whose vLLM
    hash is ``block_hashes[i]``. ``load_async``: loaded between steps, reported through
    ``get_finished`` (loads only). ``failed``: a load the scheduler could not plan; the
    workers report every block as a load error (no hashes needed). ``described``: per block,
    what its KV event says (saves, with vLLM's KV events on; else empty)."""

    req_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    load_async: bool = False
    failed: bool = False
    described: tuple[SavedBlock, ...] = ()

    def __post_init__(self) -> None:
        if not self.failed and len(self.block_ids) != len(self.block_hashes):
            raise ValueError(
                f"request {self.req_id}: {len(self.block_ids)} block ids but "
                f"{len(self.block_hashes)} block hashes"
            )


@dataclass
class PagekvMetadata(KVConnectorMetadata):
    """One step's loads (blocks to fill before, or asynchronously after, the forward) and
    saves; ``epoch``: the namespace's reset epoch (:mod:`.epoch`), part of every key;
    ``step``: the step's number (from 1), which the workers' report gives back."""

    epoch: str = ""
    step: int = 0
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass(frozen=True)
class PagekvHandshake(KVConnectorHandshakeMetadata):
    """What each worker rank tells the scheduler at start-up (vLLM's handshake metadata):
    the identity it names pages with, as it resolved it after loading the model (see
    :mod:`.identity`). The scheduler serves lookups only once every rank agrees."""

    model_id: str
    attn_backend: str


@dataclass
class PagekvWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker ranks tell the scheduler after a step (vLLM merges the ranks' with
    :meth:`aggregate`): ``unsaved``, the block hashes of saves the store did not take since the
    rank's last report (a PUT refused or failed, a write-back dropped, a save skipped). The
    scheduler then no longer takes those blocks for stored (:meth:`SchedulerSide.unsaved`).
    ``step``: the step the report follows (:attr:`PagekvMetadata.step`)."""

    unsaved: set[bytes] = field(default_factory=set)
    step: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PagekvWorkerMetadata:
        if isinstance(other, PagekvWorkerMetadata):
            self.unsaved |= other.unsaved
            self.step = max(self.step, other.step)
        return self
