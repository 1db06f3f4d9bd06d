"""Tensor parallelism across processes: rank 0 drives, ranks 1.. mirror each call.

Rank 0 runs the whole engine (scheduler, sampling) over its own model shard and
connector worker, wrapped in `TPModel` and `TPConnectorWorker`. Every call on those
is first broadcast (gloo, loopback) to the other ranks, which replay it on their own
shard and worker (`follow`), so collectives inside the model line up. Connector
outputs are gathered to rank 0 and a request only counts as sent/received once every
rank has reported it (failed if any rank failed).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvlink.connector.api import ConnectorWorker, LoadFailure, StepMetadata, WorkerOutput
from kvlink.engine.model.base import LayerStream, PagedModel

# Two groups besides the default one (used to meet). Commands: followers wait for rank
# 0's next command there while the server idles, so their side waits up to a day (they
# also die with their parent, see tp_worker); rank 0's side, which sends and so only waits
# for a follower that is busy or gone, uses the step timeout. Steps: the collectives
# inside a step (the model's all-reduces, gathering connector outputs) use the step
# timeout on every rank. A frozen or dead rank thus fails the engine with an error in
# about `step_timeout_s` instead of holding it for a day.
IDLE_TIMEOUT = datetime.timedelta(hours=24)
DEFAULT_STEP_TIMEOUT_S = 60.0
_step_group: Any = None
_command_group: Any = None


def init_group(rank: int, world_size: int, port: int, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> None:
    global _step_group, _command_group
    if step_timeout_s <= 0:
        raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=IDLE_TIMEOUT)
    ranks, step = list(range(world_size)), datetime.timedelta(seconds=step_timeout_s)
    _command_group = dist.new_group(ranks, timeout=step if rank == 0 else IDLE_TIMEOUT, backend="gloo")
    _step_group = dist.new_group(ranks, timeout=step, backend="gloo")


def all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor, group=_step_group)


def _broadcast(command: tuple[Any, ...] | None) -> tuple[Any, ...]:
    box = [command]
    dist.broadcast_object_list(box, src=0, group=_command_group)
    assert box[0] is not None
    return box[0]


def _gather(value: Any) -> list[Any] | None:
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0, group=_step_group)
    return out


class TPModel:
    """Rank 0's view of the sharded model: same `PagedModel` contract, every rank runs it."""

    def __init__(self, local: PagedModel) -> None:
        self.local = local
        self.spec, self.vocab_size, self.eos_token_ids = local.spec, local.vocab_size, local.eos_token_ids
        self.tp_rank, self.tp_size = local.tp_rank, local.tp_size

    def forward(self, input_ids: torch.Tensor, start_pos: int, block_tables: list[torch.Tensor],
                caches: list[torch.Tensor], *, block_size: int, last_token_only: bool = False,
                stream: LayerStream | None = None) -> torch.Tensor:
        sent = dataclasses.replace(stream, sink=None) if stream is not None else None  # followers: their own
        _broadcast(("forward", input_ids, start_pos, block_tables, block_size, last_token_only, sent))
        return self.local.forward(input_ids, start_pos, block_tables, caches, block_size=block_size,
                                  last_token_only=last_token_only, stream=stream)


@dataclass
class _Merge:
    """Per-request reports from the ranks, until every rank has spoken."""

    world: int
    sent: dict[str, set[int]] = field(default_factory=dict)
    recv: dict[str, set[int]] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    invalid: dict[str, set[int]] = field(default_factory=dict)
    figures: dict[str, dict[str, float]] = field(default_factory=dict)
    quarantine: dict[str, float] = field(default_factory=dict)
    failures: dict[str, LoadFailure] = field(default_factory=dict)

    def add(self, rank: int, out: WorkerOutput) -> None:
        for rid in out.finished_sending:
            self.sent.setdefault(rid, set()).add(rank)
        for rid in out.finished_recving | out.failed_recving:
            self.recv.setdefault(rid, set()).add(rank)
        self.failed |= out.failed_recving
        for rid in out.failed_recving:
            self.invalid.setdefault(rid, set()).update(out.invalid_block_ids)
        for rid, failure in out.load_failures.items():
            self.failures.setdefault(rid, failure)
        for rid, hold_s in out.quarantine_s.items():
            self.quarantine[rid] = max(self.quarantine.get(rid, 0.0), hold_s)
        for rid, fig in out.transfer_figures.items():
            merged = self.figures.setdefault(rid, {})
            for key, value in fig.items():  # bytes add up over ranks; time is the slowest rank
                merged[key] = max(merged.get(key, 0.0), value) if key.endswith("_s") else merged.get(key, 0.0) + value

    def take(self) -> WorkerOutput:
        out = WorkerOutput()
        for rid in [r for r, ranks in self.sent.items() if len(ranks) == self.world]:
            del self.sent[rid]
            out.finished_sending.add(rid)
        for rid in [r for r, ranks in self.recv.items() if len(ranks) == self.world]:
            del self.recv[rid]
            if rid in self.failed:
                self.failed.discard(rid)
                out.failed_recving.add(rid)
                out.invalid_block_ids |= self.invalid.pop(rid, set())
                if rid in self.failures:
                    out.load_failures[rid] = self.failures.pop(rid)
                if rid in self.quarantine:
                    out.quarantine_s[rid] = self.quarantine.pop(rid)
            else:
                out.finished_recving.add(rid)
            if rid in self.figures:
                out.transfer_figures[rid] = self.figures.pop(rid)
        return out


def merge_stats(snaps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' `get_stats()` as one engine's: counters (also per remote engine) add up,
    transfers are all listed, and a gauge is the highest rank's level (every rank holds the
    same requests for D, so a sum would count each one per rank)."""
    counters: dict[str, int] = {}
    by_engine: dict[tuple[str, str], int] = {}
    gauges: dict[str, float] = {}
    transfers: list[Any] = []
    for snap in snaps:
        for name, value in snap.get("counters", {}).items():
            counters[name] = counters.get(name, 0) + value
        for name, engine, value in snap.get("engine_counters", []):
            by_engine[(name, engine)] = by_engine.get((name, engine), 0) + value
        for name, level in snap.get("gauges", {}).items():
            gauges[name] = max(gauges.get(name, level), level)
        transfers += snap.get("transfers", [])
    return {"counters": counters, "transfers": transfers, "gauges": gauges,
            "engine_counters": [[name, engine, n] for (name, engine), n in sorted(by_engine.items())]}


class TPConnectorWorker(ConnectorWorker):
    """Rank 0's connector worker: its own rank's worker plus every follower's, merged."""

    def __init__(self, local: ConnectorWorker, world_size: int) -> None:
        self.local = local
        self._merge = _Merge(world_size)

    def register_kv_caches(self, base_addrs: Sequence[int], nbytes: Sequence[int]) -> None:
        self.local.register_kv_caches(base_addrs, nbytes)  # followers registered their own at start

    def start_load_kv(self, metadata: StepMetadata) -> None:
        _broadcast(("start_load_kv", metadata))
        self.local.start_load_kv(metadata)

    def get_finished(self) -> WorkerOutput:
        _broadcast(("get_finished",))
        outs = _gather(self.local.get_finished())
        assert outs is not None
        for rank, out in enumerate(outs):
            self._merge.add(rank, out)
        return self._merge.take()

    def layer_sink(self) -> Callable[..., None] | None:
        return self.local.layer_sink()  # rank 0's own layers; each follower streams its own

    def get_stats(self) -> dict[str, Any]:
        _broadcast(("get_stats",))
        return merge_stats(_gather(self.local.get_stats()) or [])

    def debug_state(self) -> dict[str, Any]:
        """Rank 0's worker state (followers mirror its requests)."""
        return self.local.debug_state()

    def shutdown(self) -> None:
        _broadcast(("shutdown",))
        self.local.shutdown()


def stop_followers() -> None:
    """Tell followers to exit (engines without a connector; `TPConnectorWorker.shutdown` does it too)."""
    _broadcast(("shutdown",))


def follow(model: PagedModel, caches: list[torch.Tensor], worker: ConnectorWorker | None) -> None:
    """A follower rank's loop: replay rank 0's calls until it says shutdown."""
    sink = worker.layer_sink() if worker is not None else None  # this rank's own layerwise writes
    while True:
        command = _broadcast(None)
        name = command[0]
        if name == "forward":
            _, input_ids, start_pos, tables, block_size, last_token_only, stream = command
            if stream is not None:
                stream = dataclasses.replace(stream, sink=sink)
            model.forward(input_ids, start_pos, tables, caches, block_size=block_size,
                          last_token_only=last_token_only, stream=stream)
        elif name == "start_load_kv":
            if worker is not None:
                worker.start_load_kv(command[1])
        elif name == "get_finished":
            _gather(worker.get_finished() if worker is not None else WorkerOutput())
        elif name == "get_stats":
            _gather(worker.get_stats() if worker is not None else {})
        elif name == "shutdown":
            if worker is not None:
                worker.shutdown()
            return
