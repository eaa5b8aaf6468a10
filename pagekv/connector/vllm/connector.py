"""``PagekvConnector``: the class vLLM 0.32 loads (``kv_connector="PagekvConnector"``,
``kv_connector_module_path="pagekv.connector.vllm"``).

vLLM makes one scheduler-role instance (EngineCore process) and one worker-role instance per
rank (worker processes); this class only dispatches to :class:`SchedulerSide` or
:class:`WorkerSide`. ``kv_role`` picks the directions: ``kv_producer`` saves and never loads,
``kv_consumer`` loads and never saves, ``kv_both`` does both.

Start-up: each worker, after loading the model and registering its KV cache, derives the
identity it names pages with (model, weight files, attention backend: :mod:`.identity`) and
hands it to the scheduler as vLLM's handshake metadata. The scheduler then builds the same
namespaces, connects to every store node (one warning names the nodes that do not answer; the
engine starts anyway) and reads the namespace's reset epoch from the store (:mod:`.epoch`).
Until then it looks nothing up and saves nothing.

Left to vLLM's defaults: ``get_mem_pool_context``, ``set_host_xfer_buffer_ops``,
``handle_preemptions`` (saves are done or stream-ordered within their step),
``get_transfer_results`` (load failures go through ``get_block_ids_with_load_errors``, which
keeps a partial hit, not ``failed_recving``), ``on_new_request``,
``get_external_cache_hit_sources`` (EXTERNAL_UNSPECIFIED), ``get_loaded_kv_cache_group_ids``,
the push hooks, ``finish_forward``, ``reset_capture_state``. ``SupportsHMA`` is not
implemented: vLLM turns its hybrid allocator off (one KV cache group; sliding-window layers
beside full-attention ones are allocated as full attention).

KV events: with vLLM's ``--kv-events-config`` on, a block the store confirmed holding for every
writer rank is a ``BlockStored`` (vLLM's hash, medium ``PAGEKV``) that vLLM's own publisher
sends (``get_kv_connector_kv_cache_events`` -> ``update_connector_output`` -> ``take_events``;
:mod:`.events`).

Saves the store did not take: each rank reports their block hashes after a step
(``build_connector_worker_meta`` -> ``update_connector_output``: :class:`PagekvWorkerMetadata`),
and the scheduler no longer takes those blocks for stored (the next lookup holding them saves
them again).

Store trouble never reaches vLLM: lookups are bounded misses, failed loads are reported as
load errors (vLLM recomputes those blocks), failed saves are counted and reported. An
unexpected error in a step is logged and handled the same way.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from pagekv.connector import KVConnector, KVIndex
from pagekv.errors import ConfigError
from pagekv.kernels import DeviceKV

from .blocks import attention_layer_names, block_views
from .config import VllmConnectorConfig, directions
from .engine import engine_layout, required_layout
from .epoch import EpochRecord
from .events import ConfirmedEvents, PagekvKVEvents, stored_events
from .identity import attention_backends, model_identity
from .metadata import PagekvHandshake, PagekvMetadata, PagekvWorkerMetadata
from .namespace import EngineLayout
from .scheduler import SchedulerSide
from .stats import PagekvStats, StatsDelta
from .worker import SaveOutcomes, WorkerSide

__all__ = ["PagekvConnector"]

log = logging.getLogger("vllm.pagekv")  # under vLLM's logger: its handlers and format


class PagekvConnector(KVConnectorBase_V1):
    """pagekv as a vLLM KV connector (see the package docstring for the settings)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = VllmConnectorConfig.from_extra(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.save_enabled, self.load_enabled = directions(self._kv_transfer_config.kv_role,
                                                          self.cfg)  # fmt: skip
        self.layout: EngineLayout | None = None
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._handshake: PagekvHandshake | None = None
        self._stats = StatsDelta()
        events = getattr(vllm_config, "kv_events_config", None)
        self.events_on = bool(events is not None and events.enable_kv_cache_events)
        self._confirmed: ConfirmedEvents | None = None  # scheduler, with events on
        if role == KVConnectorRole.SCHEDULER:
            policy = self._kv_transfer_config.kv_load_failure_policy
            if policy != "recompute":  # a cache miss must never fail a request
                log.info("pagekv: kv_load_failure_policy %r -> 'recompute'", policy)
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self.scheduler = SchedulerSide(
                None, None, save=self.save_enabled, load=self.load_enabled,
                load_async=self.cfg.load_async, save_decode=self.cfg.save_decode,
                resave_interval_s=self.cfg.resave_interval_s,
                describe_saves=self.events_on and self.save_enabled,
            )  # fmt: skip
            log.info("pagekv: %s: %s; %s loads%s", self._kv_transfer_config.kv_role,
                     _directions(self.save_enabled, self.load_enabled),
                     "asynchronous" if self.cfg.load_async else "synchronous",
                     ", layer-wise" if self.cfg.layerwise else "")  # fmt: skip

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        return required_layout(vllm_config, VllmConnectorConfig.from_extra(extra))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # layer-wise waits run in Python at each attention layer: not inside a full CUDA graph;
        # only when asked for (they serve synchronous loads, which are not the default)
        return VllmConnectorConfig.from_extra(extra_config).layerwise

    # ==== worker side ===========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        names = attention_layer_names(self._kv_cache_config)
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConfigError(f"pagekv: vLLM registered no KV cache for layers {missing}")
        handshake = PagekvHandshake(
            model_id=model_identity(self._vllm_config, self.cfg.model_id, self.cfg.weights_id),
            attn_backend=attention_backends(self._vllm_config, names),
        )  # fmt: skip
        self.layout = layout = engine_layout(
            self._vllm_config, self._kv_cache_config, model_id=handshake.model_id,
            attn_backend=handshake.attn_backend,
        )  # fmt: skip
        tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        namespace = layout.namespace(tp_rank, pp_rank)
        geo = namespace.geometry
        if geo.num_layers != len(names):
            raise ConfigError(f"pagekv: PP stage {pp_rank} has {len(names)} KV layers, "
                              f"expected {geo.num_layers}")  # fmt: skip
        views = block_views([kv_caches[n] for n in names], self._kv_cache_config.num_blocks, geo)
        describe = functools.partial(stored_events, block_size=layout.block_size)
        outcomes = SaveOutcomes(describe if self.events_on else None) if self.save_enabled else None
        conn = KVConnector(
            geo, DeviceKV.from_caches(geo, views), self.cfg.client_config(),
            host_pages=max(1, self.cfg.host_bytes // geo.page_bytes), namespace=namespace,
            max_pending_writes=self.cfg.max_pending_writes,
            lookup_timeout_s=self.cfg.lookup_timeout_s, close_timeout_s=self.cfg.flush_timeout_s,
            on_stored=outcomes.stored if outcomes is not None else None,
            on_unsaved=outcomes.unsaved if outcomes is not None else None,
        )  # fmt: skip
        if self.cfg.stats_log_s:
            conn.log_stats_every(self.cfg.stats_log_s)
        self.worker = WorkerSide(
            conn, lambda epoch: layout.namespace(tp_rank, pp_rank, epoch),
            {n: i for i, n in enumerate(names)}, load_timeout_s=self.cfg.load_timeout_s,
            save=self.save_enabled, layerwise=self.cfg.layerwise, outcomes=outcomes,
        )  # fmt: skip
        if (self.save_enabled or self.load_enabled) and not conn.connect(self.cfg.store_timeout_s):
            log.debug("pagekv: worker tp=%d pp=%d: not every store node answered at start-up",
                      tp_rank, pp_rank)  # fmt: skip
        self._handshake = handshake
        log.info("pagekv: worker tp=%d pp=%d: %d layers, %d-byte blocks, %d host pages, %s, %s",
                 tp_rank, pp_rank, geo.num_layers, geo.item_bytes, conn.pool.num_pages,
                 layout.layout, handshake.model_id)  # fmt: skip

    def get_handshake_metadata(self) -> PagekvHandshake | None:
        return self._handshake

    def _meta(self) -> PagekvMetadata | None:
        return self._connector_metadata if self.has_connector_metadata() else None  # type: ignore[return-value]

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            try:
                self.worker.bind(connector_metadata)
            except Exception:  # its asynchronous loads are reported failed, never left waiting
                log.exception("pagekv: starting asynchronous loads failed")
                self.worker.fail_unbound(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is None:
            return
        meta = self._meta()
        try:
            self.worker.start_load(meta)
        except Exception:  # never the step's error: every block of the step is recomputed
            log.exception("pagekv: load failed; the step's external blocks are recomputed")
            self.worker.fail_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return  # whole blocks are saved once per step, for all layers, in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker is None:
            return
        try:
            self.worker.save(self._meta())
        except Exception:  # a save not made is a later miss
            log.exception("pagekv: save failed")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        return None, self.worker.take_finished() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> PagekvStats | None:
        side = self.worker or self.scheduler
        return self._stats.take(side.counters) if side is not None else None

    def build_connector_worker_meta(self) -> PagekvWorkerMetadata | None:
        if self.worker is None:
            return None
        meta = self._meta()
        step = meta.step if meta is not None else 0
        unsaved = self.worker.take_unsaved()
        return PagekvWorkerMetadata(unsaved, step) if unsaved or step else None

    def get_kv_connector_kv_cache_events(self) -> PagekvKVEvents | None:
        if self.worker is None or not (self.events_on and self.save_enabled):
            return None
        return PagekvKVEvents(self.worker.take_events())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PagekvStats | None:
        return PagekvStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self.worker is not None:
            log.info("pagekv: worker stats at shutdown: %s", self.worker.stats())
            self.worker.close()
            self.worker = None
        if self.scheduler is not None:
            log.info("pagekv: scheduler stats at shutdown: %s", self.scheduler.stats())
            if self.scheduler.index is not None:
                self.scheduler.index.close()
            self.scheduler = None

    # ==== scheduler side ========================================================================
    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self._start_scheduler(list(metadata.values()))

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._start_scheduler(list(metadata.values()))

    def _start_scheduler(self, reports: list[Any]) -> None:
        """The workers' identity is known: build the namespaces, connect, read the epoch."""
        if self.scheduler is None or self.scheduler.layout is not None:
            return
        par = self._vllm_config.parallel_config
        ranks = par.tensor_parallel_size * par.pipeline_parallel_size
        idents = {(r.model_id, r.attn_backend) for r in reports if isinstance(r, PagekvHandshake)}
        if len(reports) != ranks or len(idents) != 1:
            log.error("pagekv: %d of %d worker ranks reported, with %d different page "
                      "identities: the connector stays off (no lookups, no saves)",
                      len(reports), ranks, len(idents))  # fmt: skip
            return
        ((model_id, attn),) = idents
        layout = engine_layout(self._vllm_config, self._kv_cache_config, model_id=model_id,
                               attn_backend=attn)  # fmt: skip
        self.layout = layout
        index = epochs = None
        if self.save_enabled or self.load_enabled:
            index = KVIndex(layout.all_namespaces(), self.cfg.client_config(),
                            lookup_timeout_s=self.cfg.lookup_timeout_s)  # fmt: skip
            down = index.unreachable(self.cfg.store_timeout_s)
            if down:
                log.warning("pagekv: store node(s) %s did not answer at start-up: the engine "
                            "starts; their pages are misses until they answer",
                            ", ".join(down))  # fmt: skip
            epochs = EpochRecord(index, layout.marker_key, timeout_s=self.cfg.store_timeout_s)
        if self.events_on and self.save_enabled:
            self._confirmed = ConfirmedEvents(len(layout.all_namespaces()))
        self.scheduler.activate(layout, index, epochs=epochs)
        if index is not None and self.scheduler.epoch is None:
            log.warning("pagekv: this model's epoch record cannot be read (store unreachable): "
                        "no lookups and no saves until it can")  # fmt: skip
        log.info("pagekv: scheduler ready: %s, %s, epoch %s", model_id, layout.layout,
                 self.scheduler.epoch)  # fmt: skip

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:

            def block_ids_of(req_id: str, start: int, stop: int) -> list[int]:
                blocks = kv_cache_manager.get_blocks(req_id).blocks[0]  # the list itself
                return [block.block_id for block in blocks[start:stop]]

            self.scheduler.block_ids_of = block_ids_of

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        try:
            return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # a lookup that cannot be answered is a miss
            log.exception("pagekv: lookup failed for request %s", request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if self.scheduler is None:
            return
        block_ids = lambda: blocks.get_block_ids()[0]  # noqa: E731 - only built when needed
        try:
            self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)
        except Exception:  # vLLM counts the tokens as computed: the workers must fail them
            log.exception("pagekv: planning the load of request %s failed; recomputing",
                          request.request_id)  # fmt: skip
            self.scheduler.fail_load(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PagekvMetadata:
        if self.scheduler is None:
            return PagekvMetadata()
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._confirmed is not None:
            self._confirmed.add(connector_output.kv_cache_events)
        if self.scheduler is not None:
            report = connector_output.kv_connector_worker_meta
            ours = isinstance(report, PagekvWorkerMetadata)
            self.scheduler.on_output(connector_output.invalid_block_ids,
                                     connector_output.failed_recving,
                                     report.step if ours else 0)  # fmt: skip
            if ours:
                self.scheduler.unsaved(report.unsaved)

    def take_events(self) -> Any:
        return self._confirmed.take() if self._confirmed is not None else ()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id)
        return False, None  # saves already read the blocks (CPU) or are stream-ordered (GPU)

    def reset_cache(self) -> bool:
        if self.scheduler is None:
            return True
        if self.scheduler.layout is None:
            return False  # nothing is read before start-up ends; nothing can be recorded
        return self.scheduler.reset()


def _directions(save: bool, load: bool) -> str:
    if save and load:
        return "saves and loads"
    return "saves, never loads" if save else "loads, never saves" if load else "does nothing"
