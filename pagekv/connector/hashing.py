"""Prefix page keys: one 16-byte key per full page, each naming the page's whole token prefix.

    seed  = xxh3_128("pagekv-ns-v1" | model id | geometry fingerprint | dtype | tp rank/size)
    k_0   = xxh3_128(seed  || tokens[0:P])
    k_i   = xxh3_128(k_i-1 || tokens[i*P:(i+1)*P])

Tokens are hashed as little-endian uint32, so a list, a numpy array and a torch tensor of the
same ids give the same keys, in every process and under every ``PYTHONHASHSEED``. A trailing
partial page gets no key. MLA keys leave out the tensor-parallel rank and size: every rank
holds the same latent, so every rank may read a page any rank wrote.
"""

from __future__ import annotations

import array
import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from pagekv.geometry import KVGeometry

__all__ = ["KEY_BYTES", "KeyNamespace", "page_keys", "tokens_to_bytes"]

KEY_BYTES = 16
_MAX_TOKEN = 2**32 - 1
_U32_CODE = next(code for code in ("I", "L") if array.array(code).itemsize == 4)


@dataclass(frozen=True)
class KeyNamespace:
    """What seeds the key chain: pages of different models, geometries, byte layouts, dtypes or
    ranks never share a key. Raises ``ValueError``/``TypeError`` naming the bad field.

    ``layout`` names the byte order inside a page ("pagekv" for pagekv's own page-first block;
    an engine adapter names its own, e.g. "vllm-LBHNC-cpu-vec16"). ``extra`` is any further
    namespace (a cache salt, a LoRA id). ``rank_shared`` (default: MLA) means every tensor-
    parallel rank holds the same page, so the TP rank and size are left out of the seed and
    only rank 0 writes (:attr:`is_writer`).
    """

    model_id: str
    geometry: KVGeometry
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layout: str = "pagekv"
    extra: str = ""
    rank_shared: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(
                f"KeyNamespace.model_id must be a non-empty str, got {self.model_id!r}"
            )
        if not isinstance(self.geometry, KVGeometry):
            raise TypeError(
                f"KeyNamespace.geometry must be a KVGeometry, got {type(self.geometry).__name__}"
            )
        for field in ("tp_rank", "tp_size", "pp_rank", "pp_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"KeyNamespace.{field} must be an int, got {value!r}")
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            r, n = getattr(self, rank), getattr(self, size)
            if n < 1 or not 0 <= r < n:
                raise ValueError(f"KeyNamespace: need 0 <= {rank} < {size}, got {r} and {n}")
        for field in ("layout", "extra"):
            if not isinstance(getattr(self, field), str):
                raise TypeError(f"KeyNamespace.{field} must be a str")
        if not self.layout:
            raise ValueError("KeyNamespace.layout must be non-empty")
        if self.rank_shared is None:
            object.__setattr__(self, "rank_shared", self.geometry.is_mla)
        if not isinstance(self.rank_shared, bool):
            raise TypeError(f"KeyNamespace.rank_shared must be a bool, got {self.rank_shared!r}")

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes pages to the store (rank-shared pages: rank 0 only)."""
        return not self.rank_shared or self.tp_rank == 0

    @functools.cached_property
    def seed(self) -> bytes:
        """The 16-byte chain seed (the "key" before page 0)."""
        geo = self.geometry
        rank = "shared" if self.rank_shared else f"{self.tp_rank}/{self.tp_size}"
        canon = f"pagekv-ns-v1|{self.model_id}|{geo.fingerprint}|{geo.dtype}|{rank}"
        extra = (
            ("pp", f"{self.pp_rank}/{self.pp_size}"),
            ("layout", self.layout),
            ("extra", self.extra),
        )
        defaults = ("0/1", "pagekv", "")
        if any(value != d for (_, value), d in zip(extra, defaults)):
            # each part length-prefixed: no two namespaces spell the same string
            canon = "pagekv-ns-v2|" + "|".join(
                f"{name}:{len(value)}:{value}"
                for name, value in (("model", self.model_id), ("geometry", geo.fingerprint),
                                    ("dtype", str(geo.dtype)), ("rank", rank), *extra)
            )  # fmt: skip
        return xxhash.xxh3_128_digest(canon.encode())

    def derive_keys(self, external: Sequence[bytes | str]) -> list[bytes]:
        """Namespaced 16-byte keys from an engine's own per-page hashes (vLLM's
        ``request.block_hashes``, SGLang's hex page keys), which already chain the prefix:
        ``key_i = xxh3_128(seed || external_i)``. Pure function. Raises ``TypeError`` for an
        element that is neither bytes nor str, ``ValueError`` for an empty one."""
        seed, digest, out = self.seed, xxhash.xxh3_128_digest, []
        for i, h in enumerate(external):
            if isinstance(h, str):
                h = h.encode()
            elif not isinstance(h, (bytes, bytearray, memoryview)):
                raise TypeError(f"external hash {i} must be bytes or str, got {type(h).__name__}")
            if not len(h):
                raise ValueError(f"external hash {i} is empty")
            out.append(digest(seed + bytes(h)))
        return out


def _first_bad_token(values: Sequence[Any]) -> tuple[int, Any]:
    for i, v in enumerate(values):
        if not isinstance(v, (int, np.integer)) or not 0 <= v <= _MAX_TOKEN:
            return i, v
    return -1, None


def _array_to_bytes(arr: np.ndarray) -> bytes:
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
        bad = int(np.flatnonzero((arr < 0) | (arr > _MAX_TOKEN))[0])
        raise ValueError(f"token id {arr[bad]} at position {bad} is not in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """Canonical bytes of ``token_ids``: little-endian uint32, one per token.

    Accepts a sequence of ints, a 1-D integer numpy array or torch tensor (any device).
    Raises ``ValueError`` for negative, non-integer or >= 2**32 ids, or a non-1-D input.
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex:
            raise ValueError(f"token_ids must be integers, got dtype {token_ids.dtype}")
        if token_ids.dtype == torch.bool:
            raise ValueError("token_ids must be integers, got dtype torch.bool")
        return _array_to_bytes(token_ids.detach().cpu().numpy())
    if isinstance(token_ids, np.ndarray):
        return _array_to_bytes(token_ids)
    if isinstance(token_ids, (str, bytes)):
        raise ValueError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    try:
        arr = array.array(_U32_CODE, token_ids)  # fast path: C-level range and type checks
    except (OverflowError, TypeError):
        pos, bad = _first_bad_token(list(token_ids))
        raise ValueError(
            f"token id {bad!r} at position {pos} is not an int in [0, 2**32)"
        ) from None
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def page_keys(
    token_ids: Sequence[int] | np.ndarray | torch.Tensor, namespace: KeyNamespace
) -> list[bytes]:
    """Keys of every full page of ``token_ids`` (16 bytes each; see module docstring).

    ``len(result) == len(token_ids) // namespace.geometry.page_size``. Pure function.
    Raises ``ValueError`` for bad token ids (see :func:`tokens_to_bytes`).
    """
    if not isinstance(namespace, KeyNamespace):
        raise TypeError(f"namespace must be a KeyNamespace, got {type(namespace).__name__}")
    data = tokens_to_bytes(token_ids)
    step = namespace.geometry.page_size * 4
    digest = xxhash.xxh3_128_digest
    prev = namespace.seed
    keys = []
    for start in range(0, len(data) - step + 1, step):
        prev = digest(prev + data[start : start + step])
        keys.append(prev)
    return keys
