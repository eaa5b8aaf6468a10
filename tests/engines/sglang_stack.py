"""SGLang 0.5.23's HiCache stack, built and driven the way the server does it, on CPU.

Runs in the SGLang venv (``make test-sglang``). One stack kind per process at a time: SGLang
keeps its server arguments and parallel context in process globals (a second ``build_cache``
with the same arguments, e.g. a reader next to a writer, is fine).

SGLang code that runs unmodified:

- building (``build_cache``): ``prepare_server_args`` on the launch flags (``server_args``),
  ``set_global_server_args_for_scheduler``, ``ModelConfig.from_server_args`` on a tiny
  ``config.json`` (``write_model_config``: Llama = MHA, DeepSeek-V3 = MLA, GPT-OSS = SWA + full
  attention, Qwen3-Next = gated-delta-net state in ``MambaPool`` + full attention); the model
  runner's pool builder (``resolve_layer_indices``, ``resolve_sliding_window_size``,
  ``KVCacheConfigurator._derive_pool_sizes`` and ``_init_pools``, from a ``MemoryPoolConfig``
  given here instead of one profiled from GPU memory); the scheduler's
  ``kv_cache_builder.build_kv_cache`` → ``create_tree_cache`` → ``UnifiedRadixCache.init_hicache``
  → ``attach_hybrid_pool_to_unified_cache`` → ``_PlainKvStrategy`` / ``_SwaStrategy`` /
  ``_MambaStrategy`` → host pools and ``HybridCacheController`` → the storage backend from
  SGLang's factory, with its threads;
- driving one request (``write_request``, ``read_request``), the scheduler's calls in its
  order: ``Req.init_next_round_input``; ``alloc_req_slots`` and
  ``alloc_paged_token_slots_extend`` / ``alloc_token_slots`` (as ``alloc_for_extend``);
  ``release_kv_cache(req, cache, checkpoint=True)`` at finish (radix insert, write-through);
  ``check_hicache_events`` every step; ``prefetch_from_storage`` with the arguments
  ``Scheduler._prefetch_kvcache`` passes (transcribed in ``prefetch_from_storage``: importing
  ``scheduler.py`` needs uvicorn, fastapi, setproctitle, einops); ``check_prefetch_progress`` and
  ``pop_prefetch_loaded_span`` as ``get_new_batch_prefill`` calls them;
  ``PrefillAdder.add_one_req`` (which calls ``init_load_back``); ``ready_to_load_host_cache``.
  The model forward is the one thing not run: ``fill_random`` writes the device state it would.

Stubbed, because CPU torch cannot run it:

1. Page-locked host memory: every host pool's ``pin_memory`` reads False, whatever its builder
   set (``HostKVCache.pin_memory`` made a property). SGLang builds host pools pinned, with no
   flag to change it; on CPU torch registering their buffers, and every pinned page a pool
   allocates later (the flat pages of ``get_dummy_flat_data_page``), would fail.
2. The device ⇄ host copy kernels SGLang imports from ``sgl_kernel.kvcacheio`` (and
   ``transfer_mamba``) only on CUDA/ROCm/XPU: torch stand-ins of the same signatures, set on
   ``pool_host.mha``, ``.mla`` and ``.mamba`` (``install_cpu_stubs``; calls counted in
   ``KVCACHEIO_CALLS``). They move the kernels' bytes: rows of ``item_size`` bytes, device layers
   by data pointer, host rows as the host pool lays them out, for the ``kernel`` io backend
   (``page_first``, ``layer_first``, ``page_head``) and the ``direct`` one
   (``page_first_direct``, ``layer_first``).
3. The model runner and TP worker (``_ModelRunner``, ``_TpWorker``), which only hand the pools
   above to ``build_kv_cache``; ``model_config._resolved_model_impl`` is set to SGLang's own
   implementation, as loading the model records it (the DeepSeek, GPT-OSS and Qwen3-Next model
   classes do not import here: einops).
4. Process groups: single-rank stand-ins (``cpu_group=None``) in SGLang's parallel context;
   SGLang skips its collectives at world size 1.

On CPU SGLang's own argument checks refuse the Mamba radix cache's ``extra_buffer`` strategy
("extra_buffer requires platform support for Mamba cache state snapshots",
``arg_groups/mamba_hook.py``), so the Mamba kind runs ``no_buffer``, which needs page size 1 and
``--disable-overlap-schedule`` (``KIND_FLAGS``).

Writer and reader as two processes, on pagekv nodes, through the README's launch line::

    python -m tests.engines.sglang_stack write --kinds mha swa --store tcp://127.0.0.1:7400 \\
        --extra '{"prefetch_threshold": 1}' --out /tmp/w
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import re
import shlex
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from tests.engines import sglang_env

sglang_env.stub_torchvision()

import torch  # noqa: E402
from sglang.srt.configs.model_config import AttentionArch, ModelConfig, ModelImpl  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.managers.schedule_policy import PrefillAdder  # noqa: E402
from sglang.srt.mem_cache import kv_cache_builder  # noqa: E402
from sglang.srt.mem_cache.allocation import (  # noqa: E402
    alloc_paged_token_slots_extend,
    alloc_req_slots,
    alloc_token_slots,
)
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    HybridLinearKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.model_executor.model_runner_components.layer_setup import (  # noqa: E402
    resolve_layer_indices,
)
from sglang.srt.model_executor.model_runner_components.load_model_utils import (  # noqa: E402
    resolve_sliding_window_size,
)
from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (  # noqa: E402
    SpecAuxHiddenStateConfig,
)
from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import (  # noqa: E402
    ServerArgs,
    prepare_server_args,
    set_global_server_args_for_scheduler,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

KINDS = ("mha", "mla", "swa", "mamba")

# Smallest configs the pool builders accept: 2 layers, 16-wide heads, bf16.
_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}
MODEL_CONFIGS = {
    "mha": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "mla": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 2,
        "n_group": 1,
        "topk_group": 1,
    },
    "swa": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "mamba": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "full_attention_interval": 2,  # layer 0 linear attention, layer 1 full attention
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
    },
}
# Flags a kind needs on CPU besides the caller's (see the module docstring).
KIND_FLAGS = {
    "mamba": ("--disable-overlap-schedule", "--max-mamba-cache-size", "16"),
}
# The page size each kind can run with here; Mamba's no_buffer strategy allows only 1.
DEFAULT_PAGE_SIZE = {"mha": 16, "mla": 16, "swa": 16, "mamba": 1}


def write_model_config(directory: str | Path, kind: str) -> Path:
    """Write ``config.json`` for a tiny model of ``kind``; returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**_COMMON, **MODEL_CONFIGS[kind]}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def model_kind(model_dir: str | Path) -> str:
    """The kind whose config ``write_model_config`` wrote into ``model_dir``."""
    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    for kind, config in MODEL_CONFIGS.items():
        if config["architectures"][0] == arch:
            return kind
    raise ValueError(f"{model_dir}: no kind has architecture {arch}")


README = Path(__file__).resolve().parents[2] / "README.md"
README_STORE = "tcp://kv-store-0:7400"  # the README's node endpoint, replaced by the test's


def readme_launch_flags() -> list[str]:
    """The flags of the README's SGLang launch line (the bash block that starts with
    ``python -m sglang.launch_server``), as a shell would split them."""
    match = re.search(r"```bash\n(python -m sglang\.launch_server .*?)```", README.read_text(),
                      re.S)  # fmt: skip
    if match is None:
        raise LookupError(f"{README}: no SGLang launch line")
    argv = shlex.split(match.group(1).replace("\\\n", " "))  # line continuations
    return argv[3:]  # after "python -m sglang.launch_server"


def launch_flags(
    model_dir: str | Path,
    store: Sequence[str],
    *,
    extra: dict | None = None,
    layout: str | None = None,
    prefetch_policy: str | None = None,
    drop_extra: Sequence[str] = (),
) -> list[str]:
    """The README's launch flags for ``model_dir`` and the nodes ``store``: ``extra`` updates
    the backend's extra config (``drop_extra`` removes keys), ``layout`` and
    ``prefetch_policy`` set ``--hicache-mem-layout`` / ``--hicache-storage-prefetch-policy``."""
    flags = readme_launch_flags()
    flags[flags.index("--model") + 1] = str(model_dir)
    at = flags.index("--hicache-storage-backend-extra-config") + 1
    config = json.loads(flags[at])
    if config.get("store") != [README_STORE]:
        raise LookupError(f"{README}: the launch line's store is not [{README_STORE!r}]")
    config = {**config, "store": list(store), **(extra or {})}
    for key in drop_extra:
        config.pop(key, None)
    flags[at] = json.dumps(config)
    for flag, value in (("--hicache-mem-layout", layout),
                        ("--hicache-storage-prefetch-policy", prefetch_policy)):  # fmt: skip
        if value is not None:
            flags = _set_flag(flags, flag, value)
    return flags


def _set_flag(flags: list[str], flag: str, value: str) -> list[str]:
    if flag in flags:
        at = flags.index(flag) + 1
        return [*flags[:at], value, *flags[at + 1 :]]
    return [*flags, flag, value]


def server_args(
    model_dir: str | Path,
    flags: Sequence[str],
    *,
    page_size: int | None = None,
    served_model_name: str | None = None,
    hicache_ratio: float = 2.0,
    more_flags: Sequence[str] = (),
) -> ServerArgs:
    """ServerArgs parsed by SGLang's own ``prepare_server_args`` from ``flags`` (the README's
    launch flags, :func:`launch_flags`) plus what this CPU machine needs: ``--device cpu``,
    ``--skip-tokenizer-init``, the kind's page size and flags (:data:`KIND_FLAGS`).
    ``served_model_name`` (default ``tiny-<kind>``) names the model in storage keys, so a
    writer and a reader with different model directories share pages. ``hicache_ratio`` is
    explicit because without it SGLang sizes the host pools from this machine's free memory
    after a 10 GiB reserve (``hicache_auto_size.py``) and refuses to start below that."""
    kind = model_kind(model_dir)
    cpu = [
        "--served-model-name", served_model_name or f"tiny-{kind}",
        "--device", "cpu",
        "--skip-tokenizer-init",
        "--page-size", str(page_size or DEFAULT_PAGE_SIZE[kind]),
        "--hicache-ratio", str(hicache_ratio),
    ]  # fmt: skip
    return prepare_server_args([*flags, *cpu, *KIND_FLAGS.get(kind, ()), *more_flags])


# ---- CPU stand-ins -------------------------------------------------------------------------


def _byte_rows(tensor: torch.Tensor, row_bytes: int) -> torch.Tensor:
    assert tensor.is_contiguous(), "kvcacheio stand-in needs contiguous buffers"
    return tensor.view(torch.uint8).reshape(-1, row_bytes)


def _pointer_rows(ptr: int, rows: int, row_bytes: int) -> torch.Tensor:
    raw = (ctypes.c_uint8 * (rows * row_bytes)).from_address(int(ptr))
    return torch.frombuffer(raw, dtype=torch.uint8).view(rows, row_bytes)


def _indices(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(device="cpu", dtype=torch.int64)


def _layer_rows(layers, rows: int, row_bytes: int, layer: int) -> torch.Tensor:
    """Layer ``layer`` of a device (or layer_first host) pool as byte rows: from a tensor of
    data pointers, as the kernels receive them, or from a list of tensors."""
    if isinstance(layers, torch.Tensor):
        return _pointer_rows(layers[layer].item(), rows, row_bytes)
    return _byte_rows(layers[layer], row_bytes)


def _layers_to_page_first(layers, dst, src_indices, dst_indices, item_size, layout_dim, n):
    src, dst_rows = _indices(src_indices), _indices(dst_indices)
    if src.numel() == 0:
        return
    host = _byte_rows(dst, layout_dim)
    rows = int(src.max()) + 1
    for layer in range(n):
        host[dst_rows, layer * item_size : (layer + 1) * item_size] = _layer_rows(
            layers, rows, item_size, layer
        )[src]


def _page_first_to_layer(src, dst, src_indices, dst_indices, layer, item_size, layout_dim):
    src_rows, dst_rows = _indices(src_indices), _indices(dst_indices)
    if src_rows.numel() == 0:
        return
    host = _byte_rows(src, layout_dim)
    _byte_rows(dst, item_size)[dst_rows] = host[
        src_rows, layer * item_size : (layer + 1) * item_size
    ]


def _copy_layers(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers):
    src, dst = _indices(src_indices), _indices(dst_indices)
    if src.numel() == 0:
        return
    src_n, dst_n = int(src.max()) + 1, int(dst.max()) + 1
    for layer in range(num_layers):
        _layer_rows(dst_layers, dst_n, item_size, layer)[dst] = _layer_rows(
            src_layers, src_n, item_size, layer
        )[src]


def _page_head_view(host: torch.Tensor, page_size: int, head_num: int) -> torch.Tensor:
    """page_head host rows ``[page, head, token in page, layer, head_dim]`` as bytes."""
    return host.view(torch.uint8).reshape(
        -1, head_num, page_size, host.shape[-2], host.shape[-1] * host.element_size()
    )


def _page_direct_view(host: torch.Tensor, page_size: int) -> torch.Tensor:
    """page_first_direct host rows ``[page, layer, token in page, ...]`` as bytes per token."""
    return host.view(torch.uint8).reshape(host.shape[0], host.shape[1], page_size, -1)


# sgl_kernel.kvcacheio, kernel io backend: page_first
def transfer_kv_all_layer_lf_pf(
    src_k_layers,
    dst_k,
    src_v_layers,
    dst_v,
    src_indices,
    dst_indices,
    item_size,
    dst_layout_dim,
    num_layers,
):
    for src, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        _layers_to_page_first(
            src, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers
        )


def transfer_kv_per_layer_pf_lf(
    src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size, src_layout_dim
):
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _page_first_to_layer(
            src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim
        )


def transfer_kv_all_layer_mla_lf_pf(
    src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers
):
    _layers_to_page_first(
        src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers
    )


def transfer_kv_per_layer_mla_pf_lf(
    src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim
):
    _page_first_to_layer(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim)


# kernel io backend: layer_first
def transfer_kv_all_layer(
    src_k_layers,
    dst_k_layers,
    src_v_layers,
    dst_v_layers,
    src_indices,
    dst_indices,
    item_size,
    num_layers,
):
    _copy_layers(src_k_layers, dst_k_layers, src_indices, dst_indices, item_size, num_layers)
    _copy_layers(src_v_layers, dst_v_layers, src_indices, dst_indices, item_size, num_layers)


def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size):
    transfer_kv_per_layer_mla(src_k, dst_k, src_indices, dst_indices, item_size)
    transfer_kv_per_layer_mla(src_v, dst_v, src_indices, dst_indices, item_size)


def transfer_kv_all_layer_mla(
    src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers
):
    _copy_layers(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers)


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size):
    src_rows, dst_rows = _indices(src_indices), _indices(dst_indices)
    _byte_rows(dst, item_size)[dst_rows] = _byte_rows(src, item_size)[src_rows]


# kernel io backend: page_head (MHA)
def transfer_kv_all_layer_lf_ph(
    src_k_layers,
    dst_k,
    src_v_layers,
    dst_v,
    src_indices,
    dst_indices,
    item_size,
    dst_layout_dim,
    num_layers,
    page_size,
    head_num,
):
    src, dst = _indices(src_indices), _indices(dst_indices)
    if src.numel() == 0:
        return
    for layers, host in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        view = _page_head_view(host, page_size, head_num)
        for layer in range(num_layers):
            rows = _layer_rows(layers, int(src.max()) + 1, item_size, layer)[src]
            view[dst // page_size, :, dst % page_size, layer] = rows.reshape(len(src), head_num, -1)


def transfer_kv_per_layer_ph_lf(
    src_k,
    dst_k,
    src_v,
    dst_v,
    src_indices,
    dst_indices,
    layer_id,
    item_size,
    src_layout_dim,
    page_size,
    head_num,
):
    src, dst = _indices(src_indices), _indices(dst_indices)
    for host, device in ((src_k, dst_k), (src_v, dst_v)):
        rows = _page_head_view(host, page_size, head_num)[
            src // page_size, :, src % page_size, layer_id
        ]
        _byte_rows(device, item_size)[dst] = rows.reshape(len(src), item_size)


# direct io backend: layer_first, page_first_direct (indices are whole pages of tokens)
def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    src, dst = _indices(src_indices), _indices(dst_indices)
    for src_layer, dst_layer in zip(src_layers, dst_layers):
        dst_layer[dst] = src_layer[src]


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    src, dst = _indices(src_indices), _indices(dst_indices)
    num_layers = len(src_ptrs) // len(dst_ptrs)
    for part, host in enumerate(dst_ptrs):
        view = _page_direct_view(host, page_size)
        for layer in range(num_layers):
            device = src_ptrs[part * num_layers + layer]
            view[dst // page_size, layer, dst % page_size] = _byte_rows(device, view.shape[-1])[src]


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
):
    src, dst = _indices(src_indices), _indices(dst_indices)
    for host, device in zip(src_ptrs, dst_ptrs):
        view = _page_direct_view(host, page_size)
        _byte_rows(device, view.shape[-1])[dst] = view[src // page_size, layer_id, src % page_size]


# sglang.kernels.ops.mamba.transfer_mamba
def transfer_kv_mamba_lf_pf(
    src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers
):
    _layers_to_page_first(
        src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers
    )


def transfer_kv_mamba_pf_lf(
    src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim
):
    _page_first_to_layer(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim)


_KVCACHEIO_STANDINS = {
    fn.__name__: fn
    for fn in (
        transfer_kv_all_layer_lf_pf,
        transfer_kv_per_layer_pf_lf,
        transfer_kv_all_layer_mla_lf_pf,
        transfer_kv_per_layer_mla_pf_lf,
        transfer_kv_all_layer,
        transfer_kv_per_layer,
        transfer_kv_all_layer_mla,
        transfer_kv_per_layer_mla,
        transfer_kv_all_layer_lf_ph,
        transfer_kv_per_layer_ph_lf,
        transfer_kv_direct,
        transfer_kv_all_layer_direct_lf_pf,
        transfer_kv_per_layer_direct_pf_lf,
        transfer_kv_mamba_lf_pf,
        transfer_kv_mamba_pf_lf,
    )
}
# Calls per stand-in since import: a test can check which device <-> host copies SGLang made.
KVCACHEIO_CALLS: Counter = Counter()


def _counted(fn):
    def call(*args, **kwargs):
        KVCACHEIO_CALLS[fn.__name__] += 1
        return fn(*args, **kwargs)

    call.__name__ = fn.__name__
    return call


def install_cpu_stubs() -> None:
    """Stubs 1 and 2 of the module docstring (idempotent)."""
    import sglang.srt.mem_cache.pool_host.mamba as host_mamba
    import sglang.srt.mem_cache.pool_host.mha as host_mha
    import sglang.srt.mem_cache.pool_host.mla as host_mla
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    HostKVCache.pin_memory = property(lambda self: False, lambda self, value: None)
    for module in (host_mha, host_mla, host_mamba):
        for name, fn in _KVCACHEIO_STANDINS.items():
            setattr(module, name, _counted(fn))


_SINGLE_RANK_GROUP = SimpleNamespace(
    cpu_group=None, device_group=None, world_size=1, rank_in_group=0
)


def _single_rank_context() -> None:
    """Stub 4: this process is rank 0 of every group, each of size 1."""
    get_parallel().override_permanently(
        tp_rank=0,
        pp_rank=0,
        attn_tp_rank=0,
        attn_cp_rank=0,
        tp_group=_SINGLE_RANK_GROUP,
        pp_group=_SINGLE_RANK_GROUP,
        attn_tp_group=_SINGLE_RANK_GROUP,
        attn_cp_group=_SINGLE_RANK_GROUP,
    )


@dataclass
class _ModelRunner:
    """Stub 3: what ``build_kv_cache`` reads off the model runner."""

    token_to_kv_pool: object
    model_config: ModelConfig
    spec_algorithm: SpeculativeAlgorithm = SpeculativeAlgorithm.NONE
    mtp_draft_device_pools: tuple = ()
    mtp_draft_mamba_pools: tuple = ()
    forward_stream: object = None
    prefill_aware_swa: bool = False


@dataclass
class _TpWorker:
    """Stub 3: what ``build_kv_cache`` and ``create_tree_cache`` read off the TP worker."""

    model_runner: _ModelRunner
    req_to_token_pool: object
    allocator: object
    is_hybrid_swa: bool
    sliding_window_size: int | None
    tokens_per_layer: tuple
    layer_transfer_counters: list = field(default_factory=list)

    def get_memory_pool(self):
        return self.req_to_token_pool, self.allocator

    def get_tokens_per_layer_info(self):
        return self.tokens_per_layer

    def register_hicache_layer_transfer_counter(self, counter) -> None:
        self.layer_transfer_counters.append(counter)


# ---- the stack -----------------------------------------------------------------------------


@dataclass
class Stack:
    kind: str
    args: ServerArgs
    model_config: ModelConfig
    cache: object  # UnifiedRadixCache
    req_to_token_pool: object
    allocator: object
    kv_pool: object  # the device KV pool the model runner built
    page_size: int
    build_s: float

    @property
    def controller(self):
        return self.cache.cache_controller

    @property
    def storage_backend(self):
        return self.controller.storage_backend

    @property
    def host_pools(self) -> dict[str, object]:
        return {entry.name.value: entry.host_pool for entry in self.cache.host_pool_group.entries}

    def pump(self, until, what: str, timeout: float) -> None:
        """Run the scheduler's per-step HiCache poll until ``until()``; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            self.cache.check_hicache_events()
            if until():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.kind}: {what} not done after {timeout} s")
            time.sleep(0.002)

    def close(self) -> None:
        """Detach the storage backend (SGLang's admin path: drain, stop its threads, close it)
        and free the host pools."""
        cache = self.cache
        atexit.unregister(cache.shutdown)
        try:
            if cache.enable_storage:
                ok, message = cache.detach_storage_backend()
                if not ok:
                    raise RuntimeError(f"{self.kind}: detach_storage_backend: {message}")
        finally:
            cache.release_host_resources()


def warm_native_hash() -> None:
    """Build (once) and load SGLang's page-hash extension before any storage thread needs it.

    SGLang compiles ``hicache_hash_cpp`` with torch's JIT loader on first use, which the first
    storage prefetch does on its own thread: 10-20 s here, longer than the ``timeout``
    prefetch policy's 1 s base, so that prefetch ends with 0 pages. Its build directory is
    shared by every torch of the same Python under ``~/.cache/torch_extensions``, and two
    environments with different compile commands rebuild it in turn; this venv gets its own
    directory (``TORCH_EXTENSIONS_DIR``, unless set).
    """
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    from sglang.srt.mem_cache.cpp_utils import native_hash

    native_hash._load_native_hash_module()


def build_cache(
    kind: str, args: ServerArgs, *, max_total_tokens: int = 1024, max_running_requests: int = 8
) -> Stack:
    """Build the device pools as the model runner does and the tree cache as the scheduler does."""
    install_cpu_stubs()
    warm_native_hash()
    started = time.perf_counter()
    set_global_server_args_for_scheduler(args)
    _single_rank_context()
    model_config = ModelConfig.from_server_args(args)
    model_config._resolved_model_impl = ModelImpl.SGLANG  # stub 3: what load_model records
    model = SimpleNamespace()  # no model: the layer range comes from the config

    layer_info = resolve_layer_indices(
        model=model, model_config=model_config, is_draft_worker=False
    )
    sliding_window_size = resolve_sliding_window_size(model, model_config)
    is_hybrid_swa = model_config.is_hybrid_swa
    configurator = KVCacheConfigurator(
        device="cpu",
        gpu_id=0,
        attn_dp_size=1,
        pp_size=1,
        pp_group=None,
        model=model,
        model_config=model_config,
        server_args=args,
        kv_cache_dtype=model_config.dtype,
        model_dtype=model_config.dtype,
        page_size=args.page_size,
        sliding_window_size=sliding_window_size,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        is_draft_worker=False,
        post_capture_kv_active=False,
        spec_aux_config=SpecAuxHiddenStateConfig(),
        is_hybrid_swa=is_hybrid_swa,
        is_hybrid_swa_compress=getattr(model_config, "is_hybrid_swa_compress", False),
        use_mla_backend=model_config.attention_arch == AttentionArch.MLA,
        layer_info=layer_info,
        forward_stream=None,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        memory_pool_config=None,
    )
    sizes = configurator._derive_pool_sizes(
        config=MemoryPoolConfig(
            max_total_num_tokens=max_total_tokens,
            max_running_requests=max_running_requests,
            full_max_total_num_tokens=max_total_tokens if is_hybrid_swa else None,
            swa_max_total_num_tokens=max_total_tokens if is_hybrid_swa else None,
        )
    )
    pools = configurator._init_pools(
        sizes=sizes, req_to_token_pool=None, token_to_kv_pool_allocator=None
    )
    worker = _TpWorker(
        model_runner=_ModelRunner(
            token_to_kv_pool=pools.token_to_kv_pool, model_config=model_config
        ),
        req_to_token_pool=pools.req_to_token_pool,
        allocator=pools.token_to_kv_pool_allocator,
        is_hybrid_swa=is_hybrid_swa,
        sliding_window_size=sliding_window_size,
        tokens_per_layer=(sizes.full_max_total_num_tokens, sizes.swa_max_total_num_tokens),
    )
    result = kv_cache_builder.build_kv_cache(
        server_args=args,
        model_config=model_config,
        tp_worker=worker,
        page_size=args.page_size,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        enable_metrics=False,
        enable_kv_cache_events=False,
        enable_hierarchical_cache=True,
    )
    cache = result.tree_cache
    if cache.cache_controller is None:
        raise RuntimeError(f"{kind}: SGLang built {type(cache).__name__} without HiCache")
    return Stack(
        kind=kind,
        args=args,
        model_config=model_config,
        cache=cache,
        req_to_token_pool=result.req_to_token_pool,
        allocator=result.token_to_kv_pool_allocator,
        kv_pool=pools.token_to_kv_pool,
        page_size=args.page_size,
        build_s=time.perf_counter() - started,
    )


# ---- device state: what a forward writes and a load-back restores --------------------------

# name -> (token positions, or None for a per-request state; uint8 rows)
State = dict[str, tuple[torch.Tensor | None, torch.Tensor]]


@dataclass
class _Region:
    name: str
    buffer: torch.Tensor  # slots along dim 0
    space: str  # "full" (token slot), "swa" (SWA slot of the token), "mamba" (request state slot)


def _regions(stack: Stack) -> list[_Region]:
    pool = stack.kv_pool
    regions: list[_Region] = []

    def kv(prefix: str, mha_pool, layer_ids, space: str) -> None:
        for local, layer in enumerate(layer_ids):
            regions.append(_Region(f"{prefix}k.L{layer}", mha_pool.k_buffer[local], space))
            regions.append(_Region(f"{prefix}v.L{layer}", mha_pool.v_buffer[local], space))

    if isinstance(pool, MLATokenToKVPool):
        for local, buffer in enumerate(pool.kv_buffer):
            regions.append(_Region(f"kv.L{pool.start_layer + local}", buffer, "full"))
    elif isinstance(pool, SWAKVPool):
        by_kind: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
        for layer, (local, is_swa) in pool.layers_mapping.items():
            by_kind[is_swa].append((local, layer))
        kv("", pool.full_kv_pool, [layer for _, layer in sorted(by_kind[False])], "full")
        kv("swa.", pool.swa_kv_pool, [layer for _, layer in sorted(by_kind[True])], "swa")
    elif isinstance(pool, HybridLinearKVPool):
        full_ids = sorted(
            pool.full_attention_layer_id_mapping, key=pool.full_attention_layer_id_mapping.get
        )
        kv("", pool.full_kv_pool, full_ids, "full")
        cache = stack.req_to_token_pool.mamba_pool.mamba_cache
        for layer, index in stack.req_to_token_pool.mamba_map.items():
            for c, conv in enumerate(cache.conv):
                regions.append(_Region(f"mamba.conv{c}.L{layer}", conv[index], "mamba"))
            regions.append(_Region(f"mamba.temporal.L{layer}", cache.temporal[index], "mamba"))
    else:
        kv("", pool, range(pool.start_layer, pool.start_layer + pool.layer_num), "full")
    return regions


def _slots(stack: Stack, region: _Region, full_slots: torch.Tensor, mamba_slot) -> torch.Tensor:
    if region.space == "full":
        return full_slots
    if region.space == "swa":
        return stack.allocator.full_to_swa_index_mapping[full_slots].to(torch.int64)
    return torch.as_tensor(mamba_slot, dtype=torch.int64).reshape(1)


def _row_bytes(buffer: torch.Tensor) -> int:
    return buffer[0].numel() * buffer.element_size()


def _read_rows(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    rows = buffer[slots].contiguous().view(torch.uint8)
    return rows.reshape(len(slots), _row_bytes(buffer)).clone()


def _write_rows(buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    buffer[slots] = rows.view(buffer.dtype).reshape(len(slots), *buffer.shape[1:])


def snapshot(stack: Stack, full_slots: torch.Tensor, mamba_slot=None) -> State:
    """The device state of the tokens at ``full_slots`` (positions 0..n-1), and of
    ``mamba_slot``. SWA rows are taken only where the token has an SWA slot."""
    state: State = {}
    positions = torch.arange(len(full_slots))
    for region in _regions(stack):
        if region.space == "mamba":
            if mamba_slot is not None:
                state[region.name] = (
                    None,
                    _read_rows(region.buffer, _slots(stack, region, full_slots, mamba_slot))[0],
                )
            continue
        slots = _slots(stack, region, full_slots, mamba_slot)
        keep = slots > 0 if region.space == "swa" else torch.ones(len(slots), dtype=torch.bool)
        state[region.name] = (positions[keep], _read_rows(region.buffer, slots[keep]))
    return state


def fill_random(
    stack: Stack, full_slots: torch.Tensor, mamba_slot, generator: torch.Generator
) -> None:
    """Write fresh random bytes where a forward over these tokens would write."""
    for region in _regions(stack):
        if region.space == "mamba" and mamba_slot is None:
            continue
        slots = _slots(stack, region, full_slots, mamba_slot)
        if region.space == "swa":
            slots = slots[slots > 0]
        shape = (len(slots), _row_bytes(region.buffer))
        rows = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        _write_rows(region.buffer, slots, rows)


def poison(stack: Stack, byte: int = 0xA5) -> None:
    """Fill every slot of every device state region with ``byte``."""
    for region in _regions(stack):
        region.buffer.view(torch.uint8).fill_(byte)


def mismatches(written: State, read: State) -> list[str]:
    """Regions/positions where ``read`` differs from ``written``; empty when every loaded row
    equals the written one. A region written but absent from ``read`` (no Mamba state loaded)
    is a mismatch; SWA regions hold only the positions that have an SWA slot (the trailing
    window SGLang loads), so check their positions separately."""
    problems = [f"{name}: written, not loaded" for name in written if name not in read]
    for name, (positions, rows) in read.items():
        if name not in written:
            problems.append(f"{name}: not written")
            continue
        w_rows = written[name][1]
        if positions is None:
            if not torch.equal(rows, w_rows):
                problems.append(f"{name}: state differs")
            continue
        expected = w_rows[positions]
        bad = (expected != rows).any(dim=1).nonzero().flatten()
        if len(bad):
            first = int(positions[bad[0]])
            problems.append(f"{name}: {len(bad)} of {len(positions)} rows differ, first at {first}")
    return problems


# ---- driving one request ---------------------------------------------------------------------


def _new_req(rid: str, tokens: list[int]) -> Req:
    return Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", tokens),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
    )


@dataclass
class Written:
    tokens: list[int]
    slots: torch.Tensor  # device token slots the request's KV was written to
    state: State  # the bytes written (all positions), before the cache took them over
    stored_pages: int  # pages of the prefix the backend reports as existing afterwards
    seconds: float


def _alloc_for_extend(stack: Stack, req: Req) -> torch.Tensor:
    """``alloc_for_extend`` for a batch of one request: its request row, device slots for the
    tokens past its prefix, the row written. Returns the slots of the whole prompt."""
    cache = stack.cache
    n, prefix_len = len(req.full_untruncated_fill_ids), req.prefix_len
    prefix = cache.prefix_device_indices(req).to(torch.int64) if prefix_len else None
    alloc_req_slots(stack.req_to_token_pool, [req], cache)
    if stack.page_size == 1:
        new = alloc_token_slots(cache, n - prefix_len)
    else:
        prefix_lens = torch.tensor([prefix_len], dtype=torch.int64)
        seq_lens = torch.tensor([n], dtype=torch.int64)
        new = alloc_paged_token_slots_extend(
            tree_cache=cache,
            prefix_lens=prefix_lens,
            prefix_lens_cpu=prefix_lens,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens,
            last_loc=prefix[-1:] if prefix is not None else torch.full((1,), -1),
            extend_num_tokens=n - prefix_len,
        )
    slots = new.to(torch.int64) if prefix is None else torch.cat([prefix, new.to(torch.int64)])
    stack.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), slots)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = n
    return slots


def _finish(stack: Stack, req: Req, timeout: float) -> None:
    """One output token, the request finishes (``release_kv_cache``: the radix insert and its
    write-through), then the scheduler steps until host and storage backups are acknowledged."""
    cache = stack.cache
    req.output_ids.append(req.origin_input_ids[-1])
    req.finished_reason = FINISH_LENGTH(length=1)
    release_kv_cache(req, cache, checkpoint=True)
    stack.pump(
        lambda: not cache.ongoing_write_through and not cache.ongoing_backup,
        "write-through and storage backup",
        timeout,
    )


def write_request(
    stack: Stack,
    tokens: list[int],
    *,
    generator: torch.Generator,
    rid: str = "writer",
    timeout: float = 30.0,
) -> Written:
    """One new request of prompt ``tokens`` through prefill and finish, then write-through to
    host and write-back to storage; returns once the backend acknowledged every backup."""
    started = time.perf_counter()
    if len(tokens) % stack.page_size:
        raise ValueError(f"{len(tokens)} tokens is not whole {stack.page_size}-token pages")
    req = _new_req(rid, tokens)
    req.init_next_round_input(stack.cache)
    if req.prefix_len:
        raise RuntimeError(f"{stack.kind}: the cache already holds {req.prefix_len} tokens")
    slots = _alloc_for_extend(stack, req)
    # The forward: every layer's KV (and the recurrent state) for these tokens.
    mamba_slot = req.kv.mamba_pool_idx if req.kv.holds_mamba else None
    fill_random(stack, slots, mamba_slot, generator)
    state = snapshot(stack, slots, mamba_slot)
    _finish(stack, req, timeout)
    stored = _stored_pages(stack, tokens)
    return Written(tokens, slots, state, stored, time.perf_counter() - started)


def _stored_pages(stack: Stack, tokens: list[int]) -> int:
    """Leading pages of ``tokens`` the backend holds: ``batch_exists`` (v1, the KV pages) on the
    page hashes of the tree path that holds them."""
    cache = stack.cache
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).last_device_node
    keys = [*cache.get_prefix_hash_values(node), *cache.tree_core.get_hash_values(node)]
    return stack.storage_backend.batch_exists(keys) if keys else 0


@dataclass
class Read:
    tokens: list[int]
    slots: torch.Tensor  # device token slots of the loaded prefix
    state: State  # their bytes after load-back (positions 0..len(slots)-1)
    storage_tokens: int  # tokens the prefetch brought from storage (pop_prefetch_loaded_span)
    host_hit_tokens: int  # tokens matched on host when admitted
    loaded_tokens: int  # tokens init_load_back put on device
    device_hit_tokens: int  # tokens already on device when admitted
    seconds: float
    prefetch_seconds: float


def prefetch_from_storage(stack: Stack, req: Req):
    """``Scheduler._prefetch_kvcache`` (scheduler.py), host-memory mode ``cache``, transcribed."""
    cache = stack.cache
    req.init_next_round_input(cache, cow_mamba=False)
    last_host_node = req.last_host_node
    matched_len = req.prefix_len + req.host_hit_length
    req.storage_prefetch_last_match_len = matched_len
    if cache.is_backuped(last_host_node) or cache.is_root(last_host_node):
        match_end = req._compute_max_prefix_len(len(req.full_untruncated_fill_ids))
        prefix_keys = (
            cache.get_prefix_hash_values(last_host_node)
            if cache.hicache_storage_pass_prefix_keys
            else None
        )
        return cache.prefetch_from_storage(
            req.cache_request_handle,
            last_host_node,
            req.full_untruncated_fill_ids[matched_len:match_end],
            cache.get_last_hash_value(last_host_node),
            prefix_keys,
            matched_prefix_tokens=req.full_untruncated_fill_ids[:matched_len],
            extra_key=req.extra_key,
            cache_salt=req.cache_salt,
        )
    return None


def read_request(
    stack: Stack,
    tokens: list[int],
    *,
    rid: str = "reader",
    poison_first: bool = True,
    timeout: float = 30.0,
) -> Read:
    """A new request whose prompt is ``tokens`` plus one token, admitted the way the scheduler
    admits it: storage prefetch, prefetch progress, match, ``add_one_req`` (load-back), the
    H→D load; the device state of the prefix is read there. Then the request runs to its end
    like the writer's (its extra token inserted, backed up). SGLang matches at most
    ``len(prompt) - 1`` tokens, hence the extra token. ``poison_first`` fills every device
    state slot with 0xA5 first, so loaded rows must have been overwritten (pass False to read
    again in a cache whose device tier holds the prefix)."""
    started = time.perf_counter()
    cache = stack.cache
    if poison_first:
        poison(stack)
    req = _new_req(rid, [*tokens, tokens[-1] + 1])
    handle = req.cache_request_handle

    # Arrival: _add_request_to_queue -> _prefetch_kvcache.
    prefetch_from_storage(stack, req)
    # get_new_batch_prefill, each step until the prefetch is done.
    stack.pump(lambda: cache.check_prefetch_progress(handle), "storage prefetch", timeout)
    storage_tokens, _start = cache.pop_prefetch_loaded_span(handle)
    prefetch_s = time.perf_counter() - started

    req.init_next_round_input(cache)
    host_hit, device_hit = req.host_hit_length, req.prefix_len
    adder = PrefillAdder(
        stack.page_size,
        cache,
        stack.allocator,
        running_batch=None,
        new_token_ratio=0.0,
        rem_input_tokens=1 << 20,
        rem_chunk_tokens=None,
    )
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    if req not in adder.can_run_list:
        raise RuntimeError(f"{stack.kind}: PrefillAdder did not admit the reader")
    consumer = cache.ready_to_load_host_cache()
    stack.pump(
        lambda: cache.is_load_back_event_done(consumer) and not cache.ongoing_load_back,
        "host to device load",
        timeout,
    )
    slots = cache.prefix_device_indices(req).to(torch.int64)
    # The recurrent state the prefill starts from: loaded into the request's own slot, or, on a
    # device hit, the tree's slot the forward copies from (copy-on-write).
    mamba_slot = req.kv.mamba_cow_src_index
    if req.host_loaded_length and req.kv.holds_mamba:
        mamba_slot = req.kv.mamba_pool_idx
    read = Read(
        tokens=list(tokens),
        slots=slots,
        state=snapshot(stack, slots, mamba_slot),
        storage_tokens=storage_tokens,
        host_hit_tokens=host_hit,
        loaded_tokens=req.host_loaded_length,
        device_hit_tokens=device_hit,
        seconds=0.0,
        prefetch_seconds=prefetch_s,
    )
    # The rest of the request: the extend token, its forward, finish.
    _alloc_for_extend(stack, req)
    _finish(stack, req, timeout)
    read.seconds = time.perf_counter() - started
    return read


# ---- CLI: writer and reader as two processes -------------------------------------------------


def demo_tokens(n: int = 96, start: int = 100) -> list[int]:
    """``n`` distinct token ids (96 = 6 pages of 16, or 96 pages of 1)."""
    return list(range(start, start + n))


def main(argv=None) -> int:
    """Write (or read) one prompt per kind through the README's launch line with pagekv nodes
    ``--store``; each kind's result is ``torch.save``d to ``OUT.<kind>.pt``."""
    parser = argparse.ArgumentParser(prog="python -m tests.engines.sglang_stack")
    parser.add_argument("role", choices=("write", "read"))
    parser.add_argument("--kinds", nargs="+", choices=KINDS, required=True)
    parser.add_argument("--store", nargs="+", required=True, help="pagekv node endpoints")
    parser.add_argument("--extra", default="{}", help="JSON: more backend extra config")
    parser.add_argument("--out", type=Path, required=True, help="result prefix")
    parser.add_argument("--tokens", type=int, default=96, help="prompt length, whole pages")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)

    tokens = demo_tokens(ns.tokens)
    for kind in ns.kinds:
        with tempfile.TemporaryDirectory() as model_dir:
            write_model_config(model_dir, kind)
            flags = launch_flags(model_dir, ns.store, extra=json.loads(ns.extra))
            stack = build_cache(kind, server_args(model_dir, flags))
            try:
                if ns.role == "write":
                    gen = torch.Generator().manual_seed(ns.seed)
                    result = write_request(stack, tokens, generator=gen)
                else:
                    result = read_request(stack, tokens)
            finally:
                stack.close()
        torch.save({**vars(result), "kind": kind}, f"{ns.out}.{kind}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
