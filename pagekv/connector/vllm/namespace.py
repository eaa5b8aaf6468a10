"""What names a vLLM page in the store: both the scheduler and every worker rank derive the
same :class:`EngineLayout` from vLLM's configs, so the scheduler can look up exactly the keys
each rank will load and save.

A page's key is ``xxh3_128(namespace seed || vLLM block hash)``. vLLM's block hash already
chains the prefix and the per-request parts (cache salt, LoRA, multimodal hashes); the seed
adds everything that changes the bytes of a block: the model and its weights (see
:mod:`.identity`), the TP rank and size (not for MLA, whose latent is the same on every rank),
the PP rank, the KV layout, the device and CPU attention ISA (blocks are ISA-packed on CPU),
the attention backend, the KV cache dtype (fp8 included), the block size, the block-hash
algorithm, and the reset epoch (see :mod:`.epoch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from pagekv.connector.hashing import KeyNamespace
from pagekv.errors import ConfigError
from pagekv.geometry import KVGeometry

__all__ = ["EngineLayout", "layout_id"]

_MARKER_PREFIX = b"pagekv-vllm-epoch-v1|"


def layout_id(
    *,
    kv_layout: str,
    device: str,
    isa: str,
    cache_dtype: str,
    block_size: int,
    hash_algo: str,
    attn_backend: str,
) -> str:
    """The ``layout`` part of the namespace: every vLLM setting that changes a block's bytes
    or the meaning of its hash, as one string (each part named, so no two settings collide)."""
    parts = dict(kv=kv_layout, dev=device, isa=isa, cache=cache_dtype, block=block_size,
                 hash=hash_algo, attn=attn_backend)  # fmt: skip
    return "vllm-v1|" + "|".join(f"{k}={v}" for k, v in parts.items())


@dataclass(frozen=True)
class EngineLayout:
    """The engine-wide facts that name pages. ``layers_per_stage[p]``: layers of PP stage
    ``p``. ``rank_shared`` (MLA): every TP rank holds the same block, rank 0 writes it.
    ``hash_ratio``: vLLM block hashes per block (block size / hash block size)."""

    model_id: str
    layout: str
    geometry_of: tuple[KVGeometry, ...]  # per PP stage
    block_size: int
    hash_ratio: int
    tp_size: int
    rank_shared: bool

    def __post_init__(self) -> None:
        if not self.geometry_of:
            raise ConfigError("EngineLayout needs one geometry per pipeline stage")
        if self.block_size < 1 or self.hash_ratio < 1 or self.tp_size < 1:
            raise ConfigError("EngineLayout: block_size, hash_ratio and tp_size must be >= 1")

    @property
    def pp_size(self) -> int:
        return len(self.geometry_of)

    def namespace(self, tp_rank: int, pp_rank: int, epoch: str = "") -> KeyNamespace:
        """The key namespace of one worker rank. ``epoch`` names the reset epoch of this
        model's namespace (:mod:`.epoch`): pages saved in one epoch are never read in
        another."""
        return KeyNamespace(
            self.model_id, self.geometry_of[pp_rank], tp_rank, self.tp_size,
            pp_rank=pp_rank, pp_size=self.pp_size, layout=self.layout,
            extra=f"epoch:{epoch}" if epoch else "", rank_shared=self.rank_shared,
        )  # fmt: skip

    def all_namespaces(self, epoch: str = "") -> list[KeyNamespace]:
        """Every rank's namespace, once each (MLA ranks share one per stage): a page is a hit
        for the scheduler only when it is stored under all of them."""
        tp_ranks = [0] if self.rank_shared else range(self.tp_size)
        return [self.namespace(t, p, epoch) for p in range(self.pp_size) for t in tp_ranks]

    @property
    def marker_key(self) -> bytes:
        """The store key of this namespace's epoch record (one for every rank and epoch)."""
        return xxhash.xxh3_128_digest(_MARKER_PREFIX + self.namespace(0, 0).seed)

    def num_pages(self, block_hashes: list[bytes]) -> int:
        """Full blocks that ``block_hashes`` (vLLM's ``request.block_hashes``) name."""
        return len(block_hashes) // self.hash_ratio

    def page_hash(self, block_hashes: list[bytes], i: int) -> bytes:
        """The hash of block ``i`` (the last of vLLM's hashes inside it), in O(1)."""
        return block_hashes[(i + 1) * self.hash_ratio - 1]

    def page_hashes(self, block_hashes: list[bytes], start: int = 0, stop: int | None = None):
        """Hashes of blocks ``start`` to ``stop`` (default: every full block). vLLM computes a
        hash every ``block_size / hash_ratio`` tokens, each chained over the whole prefix."""
        r = self.hash_ratio
        n = len(block_hashes) // r
        stop = n if stop is None else min(stop, n)
        if r == 1:
            return list(block_hashes[start:stop])
        return [block_hashes[(i + 1) * r - 1] for i in range(start, stop)]
