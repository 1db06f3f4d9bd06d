"""Heterogeneous TP: which P rank supplies each unit (head, conv group, latent) a D rank holds.

Works unit by unit, so it covers D_tp > P_tp, P_tp > D_tp, TP sizes that do not
divide each other, and ranks that hold replicated heads (TP > units). Every unit
a D rank holds is read exactly once; replicated P copies are spread over D ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from kvlink.layout.limits import TP, check, int_range
from kvlink.layout.spec import GDN, MLA, Mamba2, ModelSpec, ShardedPart


@dataclass(frozen=True)
class UnitRun:
    """`count` consecutive units: reader slots `[local_slot, +count)` come from
    source rank `src_rank` slots `[remote_slot, +count)`."""

    src_rank: int
    local_slot: int
    remote_slot: int
    count: int


def model_parts(model: ModelSpec) -> dict[str, ShardedPart]:
    """Every sharded part of the model, keyed as `TPMapping.runs` keys them.

    "kv": attention heads (all full/sliding groups); "g{i}.latent": an MLA group;
    "g{i}.{part}": an SSM group's conv parts and state (always head-sharded).
    """
    parts: dict[str, ShardedPart] = {}
    for gi, group in enumerate(model.groups):
        if isinstance(group, MLA):
            parts[f"g{gi}.latent"] = ShardedPart("latent", 1, group.latent_dim, replicated=True)
        elif isinstance(group, (Mamba2, GDN)):
            for part in (*group.conv_parts(), group.state_part()):
                parts[f"g{gi}.{part.name}"] = part
        else:
            parts["kv"] = model.attention_part()
    return parts


def _holders(part: ShardedPart, unit: int, local_tp: int, local_rank: int,
             remote_tp: int) -> tuple[tuple[int, int], ...]:
    """Every (source rank, slot on it) that holds global `unit`, the spread choice first.

    When the source replicates the unit, the readers that share the unit take its
    replicas in turn, so equal TP sizes map rank to rank and reads spread out.
    """
    if part.replicated:
        first = local_rank * remote_tp // local_tp
        return tuple(((first + i) % remote_tp, unit) for i in range(remote_tp))
    if remote_tp <= part.units:
        per_rank = part.units // remote_tp
        return ((unit // per_rank, unit % per_rank),)
    replicas = remote_tp // part.units
    readers_sharing_unit = max(1, local_tp // part.units)
    first = (local_rank % readers_sharing_unit) % replicas
    return tuple((unit * replicas + (first + i) % replicas, 0) for i in range(replicas))


def map_part(part: ShardedPart, local_tp: int, local_rank: int, remote_tp: int,
             reading: set[int] | None = None) -> tuple[UnitRun, ...]:
    """The runs that fill every unit slot of `part` on reader rank `local_rank`.

    A unit held by several source ranks is read from one in `reading` (ranks the reader
    already reads from) when one holds it, so no source rank is read, and no notification
    awaited, for a part it could have shared; ranks chosen are added to `reading`.
    """
    reading = set() if reading is None else reading
    first = part.first_unit(local_rank, local_tp)
    runs: list[UnitRun] = []
    for slot in range(part.units_on_rank(local_tp)):
        holders = _holders(part, first + slot, local_tp, local_rank, remote_tp)
        src, remote_slot = next((h for h in holders if h[0] in reading), holders[0])
        reading.add(src)
        prev = runs[-1] if runs else None
        if prev and prev.src_rank == src and prev.remote_slot + prev.count == remote_slot:
            runs[-1] = UnitRun(src, prev.local_slot, prev.remote_slot, prev.count + 1)
        else:
            runs.append(UnitRun(src, slot, remote_slot, 1))
    return tuple(runs)


@cache
def _reader_runs(model: ModelSpec, local_tp: int, local_rank: int,
                 remote_tp: int) -> dict[str, tuple[UnitRun, ...]]:
    """Runs of every part for one reader: parts with a single holder per unit first, so the
    parts that source ranks replicate can be read from ranks already being read."""
    parts = model_parts(model)
    single = [k for k, p in parts.items() if not p.replicated and remote_tp <= p.units]
    shared = [k for k in parts if k not in single]
    reading: set[int] = set()
    mapped = {k: map_part(parts[k], local_tp, local_rank, remote_tp, reading) for k in single + shared}
    return {k: mapped[k] for k in parts}


@dataclass(frozen=True)
class TPMapping:
    """What one reader rank reads, and which source ranks it must notify per request."""

    local_tp: int
    local_rank: int
    remote_tp: int
    runs: dict[str, tuple[UnitRun, ...]]
    notify_only_ranks: tuple[int, ...]

    @property
    def source_ranks(self) -> tuple[int, ...]:
        """Ranks this reader reads from, ascending."""
        return tuple(sorted({run.src_rank for runs in self.runs.values() for run in runs}))

    @property
    def notify_ranks(self) -> tuple[int, ...]:
        """Every source rank this reader notifies once per request (read or notify-only)."""
        return tuple(sorted({*self.source_ranks, *self.notify_only_ranks}))

    def runs_from(self, key: str, src_rank: int) -> tuple[UnitRun, ...]:
        return tuple(run for run in self.runs.get(key, ()) if run.src_rank == src_rank)


@cache
def _read_sources(model: ModelSpec, local_tp: int, remote_tp: int) -> tuple[frozenset[int], ...]:
    return tuple(
        frozenset(run.src_rank for runs in _reader_runs(model, local_tp, rank, remote_tp).values()
                  for run in runs)
        for rank in range(local_tp)
    )


def _notify_only(model: ModelSpec, local_tp: int, local_rank: int, remote_tp: int) -> tuple[int, ...]:
    """Source ranks no reader reads from are notified by reader `p * local_tp // remote_tp`."""
    read_by_anyone = frozenset().union(*_read_sources(model, local_tp, remote_tp))
    return tuple(
        p for p in range(remote_tp)
        if p not in read_by_anyone and p * local_tp // remote_tp == local_rank
    )


def _check_tp_shards(model: ModelSpec, tp_size: int, side: str) -> None:
    """ValueError unless a `tp_size` engine can hold `model` (every part splits over it)."""
    check(f"{side} TP size", tp_size, TP)
    _check_parts_split(model, int(tp_size), side)


@cache
def _check_parts_split(model: ModelSpec, tp_size: int, side: str) -> None:
    for part in model_parts(model).values():
        try:
            part.units_on_rank(tp_size)
        except ValueError as exc:
            raise ValueError(f"{side} TP size {tp_size}: {exc}") from None


def check_tp_pair(model: ModelSpec, local_tp: int, remote_tp: int) -> None:
    """ValueError naming the side whose TP size is out of range or does not shard the model."""
    _check_tp_shards(model, local_tp, "local")
    _check_tp_shards(model, remote_tp, "remote")


def compute_tp_mapping(model: ModelSpec, local_tp: int, local_rank: int, remote_tp: int) -> TPMapping:
    """The mapping for reader `local_rank` of a `local_tp` engine against a `remote_tp` engine.

    ValueError when either TP size is out of range or does not shard the model's heads
    (and conv groups), or the rank is not one of the local engine's."""
    check_tp_pair(model, local_tp, remote_tp)
    check("local rank", local_rank, int_range(0, local_tp - 1))
    runs = dict(_reader_runs(model, local_tp, local_rank, remote_tp))
    return TPMapping(local_tp, local_rank, remote_tp, runs,
                     _notify_only(model, local_tp, local_rank, remote_tp))


def consumers_per_producer(model: ModelSpec, producer_tp: int, consumer_tp: int) -> tuple[int, ...]:
    """Notifications each producer (P) rank waits for per request: one per consumer rank that
    reads from it or is assigned to notify it. Every entry is at least 1. ValueError for TP
    sizes that `compute_tp_mapping` refuses."""
    check_tp_pair(model, consumer_tp, producer_tp)
    counts = [0] * producer_tp
    for rank in range(consumer_tp):
        for p in compute_tp_mapping(model, consumer_tp, rank, producer_tp).notify_ranks:
            counts[p] += 1
    return tuple(counts)
