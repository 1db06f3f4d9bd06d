"""`KvlinkConnector`: a vLLM V1 KV connector (found by name through `.plugin`, or by
`kv_connector_module_path`) on kvlink's connector core. One instance per role: SCHEDULER
in the EngineCore process, WORKER in each worker process; the API-server process only
imports the class.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

from kvlink.connector.api import StepMetadata
from kvlink.integrations.vllm.layout import (
    SSM_KINDS,
    SUPPORTED_LAYOUT,
    GroupInfo,
    UnsupportedVllmLayout,
    kv_dtype_for,
    layer_index,
    model_spec,
    resolved_isa,
    storage_dtype,
    with_kv_dtype,
)
from kvlink.integrations.vllm.mla import MLA_KIND, mla_group, mla_model_spec, mla_page_order
from kvlink.integrations.vllm.options import (
    agent_config,
    connector_config,
    metrics_port,
    queue_busy_poll_s,
    stuck_step_dump_s,
    with_start_incarnation,
)
from kvlink.integrations.vllm.plugin import START_ENV
from kvlink.integrations.vllm.scheduler_side import SchedulerSide
from kvlink.integrations.vllm.spin import shorten_queue_spin
from kvlink.integrations.vllm.stats import KvlinkPromMetrics, KvlinkStats
from kvlink.integrations.vllm.stuck_step import StepWatchdog
from kvlink.integrations.vllm.worker_side import TORCH_DTYPES, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

_vllm_log = init_logger("vllm.kvlink")
IDLE_STEP_S = 0.005


def _route_kvlink_logs() -> None:
    """kvlink's loggers write through vLLM's handlers, so their lines land in vLLM's log."""
    kvlink_log, vllm_log = logging.getLogger("kvlink"), logging.getLogger("vllm")
    if not kvlink_log.handlers and vllm_log.handlers:
        for handler in vllm_log.handlers:
            kvlink_log.addHandler(handler)
        kvlink_log.setLevel(logging.INFO)
        kvlink_log.propagate = False


@dataclass
class KvlinkMetadata(KVConnectorMetadata):
    """One scheduler step's work for every worker (plain data; pickled to the workers)."""

    step: StepMetadata = field(default_factory=StepMetadata)


def _model_name(vllm_config: VllmConfig) -> str:
    return os.path.basename(os.path.normpath(str(vllm_config.model_config.model)))


SUPPORTED_GROUPS = ("one full-attention group (FullAttentionSpec, with or without a sliding window), "
                    "optionally with Mamba2 or GDN groups (MambaSpec, a hybrid model such as GraniteMoeHybrid or "
                    "Qwen3-Next); or sliding-window groups (SlidingWindowSpec), alone or with full-attention "
                    "groups (hybrid allocator on, at TP 1 when there is more than one group); or one MLA "
                    "group alone (MLAAttentionSpec, a DeepSeek-V2/V3-like latent cache)")


def _dtype_name(dtype: Any) -> str:
    return TORCH_DTYPES.get(str(dtype), str(dtype))


def _plain_attention(spec: Any) -> bool:
    """Causal attention over every token kept (no chunked-local attention, no blocks kept past
    the window for speculative decoding): the kinds kvlink's window math describes."""
    return (not getattr(spec, "attention_chunk_size", None) and not getattr(spec, "non_causal", False)
            and not getattr(spec, "extra_retained_tokens", 0))


def _conv_state_layout() -> str:
    """vLLM's conv-state layout for Mamba pages ("SD" by default, "DS" through its environment)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(get_conv_state_layout())


def _mamba_n_groups(model_config: Any) -> int | None:
    """The model's Mamba2 B/C group count, as its config names it (None when it names none)."""
    config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    for key in ("mamba_n_groups", "n_groups"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _mamba_kind(spec: Any) -> str:
    """"mamba2", "gdn" or vLLM's own name for another state kind (MAMBA1, SHORT_CONV, ...)."""
    name = str(getattr(spec.mamba_type, "name", spec.mamba_type)).upper()
    return {"MAMBA2": "mamba2", "GDN_ATTN": "gdn"}.get(name.rsplit(".", 1)[-1], name)


def _kv_groups(kv_cache_config: KVCacheConfig | None) -> list[GroupInfo]:
    """vLLM's KV-cache groups in kvlink's terms; refuses kinds kvlink cannot move exactly."""
    if kv_cache_config is None:
        raise UnsupportedVllmLayout("kvlink: vLLM gave the connector no kv_cache_config")
    out = []
    kinds = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
    for group in kv_cache_config.kv_cache_groups:
        spec: Any = group.kv_cache_spec  # its kind's own fields are read by name below
        kind = type(spec).__name__
        if kind == "MLAAttentionSpec":
            out.append(mla_group(spec, tuple(group.layer_names), _dtype_name(spec.dtype)))
        elif kind in ("FullAttentionSpec", "SlidingWindowSpec") and _plain_attention(spec):
            # A FullAttentionSpec with a sliding window (the hybrid allocator off) keeps every
            # block, and its global layers need them all: it moves whole, as full attention.
            window = int(spec.sliding_window) if kind == "SlidingWindowSpec" else 0
            out.append(GroupInfo("sliding" if window else "attention", tuple(group.layer_names),
                                 _dtype_name(spec.dtype), num_kv_heads=int(spec.num_kv_heads),
                                 head_dim=int(spec.head_size), block_size=int(spec.block_size),
                                 sliding_window=window))
        elif kind == "MambaSpec" and _mamba_kind(spec) in SSM_KINDS:
            # One dtype per state shape: the conv state's, then the SSM state's.
            conv_dtype, *state_dtypes = (_dtype_name(d) for d in spec.dtypes)
            state_dtype = state_dtypes[0] if len(state_dtypes) == 1 else "+".join(state_dtypes)
            out.append(GroupInfo(_mamba_kind(spec), tuple(group.layer_names), conv_dtype,
                                 state_dtype="" if state_dtype == conv_dtype else state_dtype,
                                 conv_shape=tuple(int(x) for x in spec.shapes[0]),
                                 state_shape=tuple(int(x) for x in spec.shapes[1]),
                                 page_bytes=int(getattr(spec, "real_page_size_bytes", 0)),
                                 page_stride=int(spec.page_size_bytes), conv_layout=_conv_state_layout()))
        else:
            raise UnsupportedVllmLayout(f"kvlink: this model's KV cache groups are {kinds}; kvlink inside vLLM "
                                        f"moves {SUPPORTED_GROUPS}")
    if [g.kind for g in out] == [MLA_KIND]:
        return out
    if any(g.kind == MLA_KIND for g in out) or not any(g.is_attention for g in out):
        raise UnsupportedVllmLayout(f"kvlink: this model's KV cache groups are {kinds}; kvlink inside vLLM "
                                    f"moves {SUPPORTED_GROUPS}")
    return out


class KvlinkConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # Typed optional here (a None is refused with a clear error where the groups are read); the
        # base class only stores it.
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        _route_kvlink_logs()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self._extra = dict(transfer.kv_connector_extra_config or {})
        self.config = connector_config(
            transfer.kv_connector_extra_config, engine_id=str(transfer.engine_id),
            load_failure_policy=str(transfer.kv_load_failure_policy))
        self.config = with_start_incarnation(self.config, os.environ.get(START_ENV, ""))
        cache = vllm_config.cache_config
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        kv_dtype = kv_dtype_for(cache.cache_dtype, _dtype_name(model_config.dtype))
        groups = with_kv_dtype(_kv_groups(kv_cache_config), kv_dtype)
        hybrid = len(groups) > 1
        tp_size = parallel.tensor_parallel_size
        if hybrid and tp_size != 1 and not any(g.kind in SSM_KINDS for g in groups):
            raise UnsupportedVllmLayout(f"kvlink: attention models of several KV-cache groups (sliding window, "
                                        f"hybrid allocator on) inside vLLM move at TP 1 only; this engine "
                                        f"runs TP {tp_size}")
        spec = next(g for g in groups if g.is_attention or g.kind == MLA_KIND)
        dtype = spec.dtype
        self._spec, self._groups = spec, groups
        self._attention_names = tuple(name for g in groups if g.is_attention or g.kind == MLA_KIND
                                      for name in g.layer_names)
        model = (mla_model_spec(_model_name(vllm_config), spec) if spec.kind == MLA_KIND
                 else model_spec(_model_name(vllm_config), groups, model_config.get_total_num_kv_heads(),
                                 tp_size=tp_size, mamba_n_groups=_mamba_n_groups(model_config)))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._watchdog: StepWatchdog | None = None
        if role == KVConnectorRole.SCHEDULER:
            assert kv_cache_config is not None
            self._scheduler = SchedulerSide(self.config, parallel.tensor_parallel_size, model,
                                            kv_cache_config.transfer_group_ids)
            self._shorten_queue_spin()
            _vllm_log.info("kvlink connector (scheduler) for engine %s: %s mode, policy %s, lease %.0f s, "
                           "stall deadline %.0f s, verify_kv %s", self.config.engine_id, self.config.transfer_mode,
                           self.config.load_failure_policy, self.config.lease_s, self.config.stall_timeout_s,
                           self.config.verify_kv)
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )
            if storage_dtype(dtype) != dtype:
                model = replace(model, kv_scales=self._kv_scales(spec.layer_names))
            rank, ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            self._worker = WorkerSide(
                self.config, model, tp_size=ranks, tp_rank=rank,
                head_dim=spec.head_dim, block_size=spec.block_size, dtype=dtype,
                groups=groups if hybrid else None,
                metrics_port=metrics_port(transfer.kv_connector_extra_config),
                agent_config=agent_config(transfer.kv_connector_extra_config))
            limit_s = stuck_step_dump_s(transfer.kv_connector_extra_config)
            if limit_s is not None:
                self._watchdog = StepWatchdog(limit_s, f"kvlink worker rank {rank}/{ranks}")

    # ---- class-level hooks --------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return SUPPORTED_LAYOUT

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvlinkStats:
        return KvlinkStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvlinkPromMetrics:
        return KvlinkPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side -----------------------------------------------------------------
    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker-role connector"
        return self._scheduler

    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return self._sched().transfer_group_ids

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        side = self._sched()
        if getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0 and side.has_pending_work():
            # An empty step that only waits on kvlink (P's leases, D's loads): vLLM loops on
            # these as fast as it can. Pace them, so an engine holding a lease does not take
            # the core a peer on the same machine needs to read it.
            time.sleep(IDLE_STEP_S)
        return KvlinkMetadata(side.build_step(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, [block_ids])

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def _shorten_queue_spin(self) -> None:
        busy_poll_s = queue_busy_poll_s(self._extra)
        if busy_poll_s is not None:
            shorten_queue_spin(busy_poll_s)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # ---- worker side --------------------------------------------------------------------
    def _work(self) -> WorkerSide:
        assert self._worker is not None, "worker-side call on a scheduler-role connector"
        return self._worker

    def _attention_layers(self, names: tuple[str, ...]) -> dict[str, Any]:
        layers = self._vllm_config.compilation_config.static_forward_context
        missing = [name for name in names if name not in layers]
        if missing:
            raise UnsupportedVllmLayout(f"kvlink: vLLM has no attention layers named {missing}")
        return {name: layers[name] for name in names}

    def _kv_scales(self, names: tuple[str, ...]) -> tuple[tuple[float, float], ...]:
        """Each layer's (k_scale, v_scale) of a quantized cache, as loaded (1.0 unless the
        checkpoint has scales): P and D compare them at the handshake."""
        layers = self._attention_layers(names)
        return tuple((float(layers[name]._k_scale_float), float(layers[name]._v_scale_float))
                     for name in sorted(names, key=layer_index))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._shorten_queue_spin()
        spec = self._spec
        # vLLM's CPU_ATTN metadata builders set each layer's `isa` before the KV cache is
        # allocated: the kernel vLLM runs, hence the page order, is read, not re-derived.
        layers = self._attention_layers(self._attention_names)
        if spec.kind == MLA_KIND:
            order = mla_page_order({name: layer.attn_backend.get_name() for name, layer in layers.items()})
            _vllm_log.info("kvlink: vLLM's MLA layers run %s (latent %d of %s, block %d): page order %s",
                           next(iter(layers.values())).attn_backend.get_name(), spec.head_dim, spec.dtype,
                           spec.block_size, order)
            self._work().register_mla_caches(kv_caches, order)
            return
        isa = resolved_isa({name: (layer.attn_backend.get_name(), getattr(layer, "isa", None))
                            for name, layer in layers.items()})
        scales = sorted(set(self._work().model.kv_scales))
        conv = sorted({(g.kind, g.conv_layout) for g in self._groups if g.kind in SSM_KINDS})
        for kind, layout in conv:
            _vllm_log.info("kvlink: vLLM's %s layers keep their conv state %s (moved as it lies)",
                           "Mamba2" if kind == "mamba2" else "GDN", layout)
        _vllm_log.info("kvlink: vLLM's CPU_ATTN attention runs the %r kernel (KV cache %s, block %d, head size %d%s)",
                       isa, spec.dtype, spec.block_size, spec.head_dim,
                       f", k/v scales {scales}" if scales else "")
        self._work().register_kv_caches(kv_caches, spec.num_kv_heads, isa)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds each step's metadata before the step's forward: where a step begins.
        super().bind_connector_metadata(connector_metadata)
        if self._watchdog is not None:
            self._watchdog.begin()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvlinkMetadata)
        self._work().start_load_kv(metadata.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are async (a request runs only after its load finished); the layer boundary
        # is where the worker lets NIXL progress during a forward pass.
        self._work().progress()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Pull and push move P's blocks after the request finished; layerwise requests write
        # this layer's new chunks to D right now.
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(metadata, KvlinkMetadata) and metadata.step.layer_progress:
            self._work().save_kv_layer(layer_name, metadata.step)

    def wait_for_save(self) -> None:
        # After the forward: seal the requests whose prefill it completed (verify_kv), so
        # their digests are in place before P's answer goes out.
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(metadata, KvlinkMetadata) and metadata.step.seals:
            self._work().seal_now(metadata.step.seals)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # vLLM asks for the step's results once its forward and saves are done: where it ends.
        try:
            out = self._work().poll()
        finally:
            if self._watchdog is not None:
                self._watchdog.end()
        return KVConnectorTransferResults(
            finished_sending=set(out.finished_sending),
            # vLLM releases a request from its wait only if a failed load is also "finished".
            finished_recving=set(out.finished_recving) | set(out.failed_recving),
            failed_recving=set(out.failed_recving),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failures go per request through failed_recving (safe with any group count)

    def get_kv_connector_stats(self) -> KvlinkStats | None:
        if self._worker is None:
            return None
        data = self._worker.stats_payload()
        return KvlinkStats(data=data) if data is not None else None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._watchdog is not None:
            self._watchdog.close()
        if self._worker is not None:
            self._worker.shutdown()
