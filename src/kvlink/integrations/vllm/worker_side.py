"""The WORKER-role half inside each vLLM worker process: registers vLLM's KV views with
kvlink's NixlWorker and maps its output onto vLLM's finished/failed sets and stats."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvlink.connector.api import StepMetadata, WorkerOutput
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.worker import NixlWorker
from kvlink.integrations.vllm.layout import (
    GroupInfo,
    LayerTensor,
    UnsupportedVllmLayout,
    check_hybrid_tensors,
    check_layer_tensors,
    layer_index,
    order_layers,
    page_order_for,
)
from kvlink.integrations.vllm.mla import check_mla_tensors
from kvlink.integrations.vllm.stats import Forwarded, carries_anything, from_worker_snapshot
from kvlink.integrations.vllm.worker_metrics import WorkerMetrics
from kvlink.layout.spec import ModelSpec
from kvlink.transfer.agent_config import AgentConfig

PROGRESS_EVERY_S = 0.001
log = logging.getLogger("kvlink.vllm")

TORCH_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def layer_tensors(kv_caches: dict[str, Any]) -> list[LayerTensor]:
    """vLLM's registered cache tensors as plain numbers (address, shape, strides, dtype)."""
    return [LayerTensor(name, int(t.data_ptr()), tuple(t.shape), tuple(t.stride()), int(t.element_size()),
                        TORCH_DTYPES.get(str(t.dtype), str(t.dtype)))
            for name, t in kv_caches.items()]


class WorkerSide:
    def __init__(self, config: ConnectorConfig, model: ModelSpec, *, tp_size: int, tp_rank: int,
                 head_dim: int, block_size: int, dtype: str,
                 metrics_port: int | None = None, agent_config: AgentConfig | None = None,
                 groups: Sequence[GroupInfo] | None = None) -> None:
        self.config = config
        self.model = model
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.head_dim = head_dim
        self.block_size, self.dtype = block_size, dtype
        self.core: NixlWorker | None = None
        self._last_progress = 0.0
        self._forwarded = Forwarded()
        self._metrics_port = metrics_port
        self._agent_config = agent_config
        self._groups = groups  # hybrid: vLLM's groups, whose layers alias one allocation
        self.metrics: WorkerMetrics | None = None
        self._layer_of: dict[str, int] = {}  # layerwise: vLLM layer name -> kvlink layer
        self._progress: list[dict[str, Any]] = []  # this step's layerwise requests
        # Stalled loads, reported to vLLM only once their quarantine is over (request -> when):
        # vLLM frees or recomputes into a failed load's blocks at once, and a frozen peer may
        # still deliver into them when it runs again. Until then the request holds them.
        self._held: dict[str, float] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any], local_kv_heads: int, isa: str) -> None:
        """Register vLLM's KV views; `isa` is the CPU attention kernel vLLM resolved for them."""
        tensors = layer_tensors(kv_caches)
        order = page_order_for(isa, self.dtype, self.block_size, self.head_dim)
        ssm_page_stride: int | None = None
        if self._groups is not None:
            bases, sizes, num_blocks, ssm_page_stride = check_hybrid_tensors(tensors, self._groups)
            # kvlink's layers are vLLM's in layer order, whatever group each belongs to
            names = sorted((name for g in self._groups for name in g.layer_names), key=layer_index)
            self._layer_of = {name: i for i, name in enumerate(names)}
        else:
            layers = order_layers(tensors)
            self._layer_of = {t.name: i for i, t in enumerate(layers)}
            if len(layers) != self.model.num_layers:
                raise UnsupportedVllmLayout(
                    f"kvlink: vLLM registered KV caches of {len(layers)} distinct layers "
                    f"{[t.name for t in layers]}; its KV-cache group has {self.model.num_layers}")
            bases, sizes, num_blocks = check_layer_tensors(
                layers, num_kv_heads=local_kv_heads, block_size=self.block_size, head_dim=self.head_dim,
                dtype=self.dtype)
        self._start(bases, sizes, num_blocks, order, ssm_page_stride)

    def register_mla_caches(self, kv_caches: dict[str, Any], order: str) -> None:
        """Register vLLM's MLA latent caches (`[blocks, block_size, latent]` per layer)."""
        tensors = layer_tensors(kv_caches)
        bases, sizes, num_blocks = check_mla_tensors(tensors, block_size=self.block_size,
                                                     latent_dim=self.head_dim, dtype=self.dtype)
        self._layer_of = {t.name: i for i, t in enumerate(sorted(tensors, key=lambda t: layer_index(t.name)))}
        self._start(bases, sizes, num_blocks, order, None)

    def _start(self, bases: list[int], sizes: list[int], num_blocks: int, order: str,
               ssm_page_stride: int | None) -> None:
        core = NixlWorker(self.config, self.model, self.tp_size, self.tp_rank, self.block_size, self.block_size,
                          num_blocks, agent_config=self._agent_config, page_order=order,
                          ssm_page_stride=ssm_page_stride, aliased=self._groups is not None)
        core.register_kv_caches(bases, sizes)
        self.core = core
        if self._metrics_port is not None:
            self.metrics = WorkerMetrics(self.config.side_channel_host, self._metrics_port + self.tp_rank,
                                         self.debug_state, f'engine_id="{self.config.engine_id}",rank="{self.tp_rank}"')
            log.info("kvlink worker metrics on http://%s:%d/metrics", self.config.side_channel_host, self.metrics.port)
        log.info("kvlink in vLLM: rank %d/%d registered %d layers x %d blocks of %d tokens (%s, page order "
                 "%s), side channel %s:%d", self.tp_rank, self.tp_size, self.model.num_layers, num_blocks,
                 self.block_size, self.dtype, order, self.config.side_channel_host, core.side_channel_port)

    def start_load_kv(self, step: StepMetadata) -> None:
        assert self.core is not None, "register_kv_caches first"
        refused = [e for e in step.loads if "error" in e]
        if refused:
            step.loads = [e for e in step.loads if "error" not in e]
            for entry in refused:
                blocks = {int(b) for ids in entry.get("local_block_ids", []) for b in ids}
                self.core.fail_request(entry["request_id"], blocks, entry["error"], bad_params=True)
        self.core.start_load_kv(step)

    def save_kv_layer(self, layer_name: str, step: StepMetadata) -> None:
        """After attention layer `layer_name` of a forward: the layerwise requests' new chunks
        of that layer go to D now (vLLM's `save_kv_layer`). `step` is the metadata bound for
        this forward: vLLM's CPU runner calls `start_load_kv` only after the forward, so the
        step's new streams are opened here, at its first layer."""
        layer = self._layer_of.get(layer_name)
        if self.core is None or self.core.push is None or layer is None or not step.layer_progress:
            return
        push = self.core.push
        if self._progress is not step.layer_progress:
            self._progress = step.layer_progress
            for stream in step.streams:
                push.open_stream(stream)
        for entry in self._progress:
            push.save_kv_layer(entry["request_id"], layer, int(entry["end"]), entry["block_ids"])

    def seal_now(self, seals: Sequence[dict[str, Any]]) -> None:
        if self.core is not None:
            self.core.seal_now(seals)

    def progress(self) -> None:
        """Called at every attention layer of a forward pass: drive NIXL at most once per
        PROGRESS_EVERY_S. With no progress thread, a peer's READ from us (or its notification)
        otherwise waited for our whole forward pass (~250 ms for a 256-token prefill here)."""
        if self.core is None:
            return
        now = time.monotonic()
        if now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            self.core.progress()

    def poll(self) -> WorkerOutput:
        if self.core is None:
            return WorkerOutput()
        out = self.core.get_finished()
        self._hold_stalled(out, time.monotonic())
        for rid, fig in out.transfer_figures.items():
            relayout = (f", re-laid out in {1e3 * fig['kv_relayout_s']:.2f} ms" if "kv_relayout_s" in fig else "")
            log.info("kvlink load %s: %d bytes in %.2f ms (%d descriptors%s)", rid, int(fig.get("kv_bytes", 0)),
                     1e3 * float(fig.get("kv_transfer_s", 0.0)), int(fig.get("kv_descriptors", 0)), relayout)
        for rid in out.finished_sending:
            log.info("kvlink send %s: done, blocks released", rid)
        for rid, failure in out.load_failures.items():
            log.warning("kvlink load %s failed: %s", rid, failure.reason)
        return out

    def stats_payload(self) -> dict[str, Any] | None:
        if self.core is None:
            return None
        snapshot = self.core.get_stats()
        if self.metrics is not None:
            self.metrics.update(snapshot)
        data = from_worker_snapshot(snapshot, self._forwarded)
        return data if carries_anything(data) else None

    def _hold_stalled(self, out: WorkerOutput, now: float) -> None:
        """Keep a stalled load's failure from vLLM for its quarantine (`quarantine_s`), so the
        request keeps its blocks while a frozen peer may still write into them; report the
        failures whose time has come."""
        for rid, hold_s in out.quarantine_s.items():
            if rid in out.failed_recving and hold_s > 0:
                out.failed_recving.discard(rid)
                self._held[rid] = now + hold_s
                log.warning("kvlink load %s stalled: its blocks stay with the request for %.0f s "
                            "(quarantine_s) before vLLM hears of the failure; a frozen peer may still "
                            "deliver into them", rid, hold_s)
        for rid, until in list(self._held.items()):
            if until <= now:
                del self._held[rid]
                out.failed_recving.add(rid)

    def debug_state(self) -> dict[str, Any]:
        state = self.core.debug_state() if self.core is not None else {}
        return {**state, "quarantined_loads": len(self._held)}

    def shutdown(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.core is not None:
            self.core.shutdown()
            self.core = None
