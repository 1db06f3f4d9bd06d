"""Heterogeneous TP: which P rank supplies each unit (head, conv group, latent) a D rank holds.

Works unit by unit, so it covers D_tp > P_tp, P_tp > D_tp, TP sizes that do not
divide each other, and ranks that hold replicated heads (TP > units). Every unit
a D rank holds is read exactly once; replicated P copies are spread over D ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

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


def _supplier(
    part: ShardedPart, unit: int, local_tp: int, local_rank: int, remote_tp: int,
) -> tuple[int, int]:
    """(source rank, slot on it) for global `unit`.

    When the source replicates the unit, the readers that share the unit take its
    replicas in turn, so equal TP sizes map rank to rank and reads spread out.
    """
    if remote_tp <= part.units:
        per_rank = part.units // remote_tp
        return unit // per_rank, unit % per_rank
    replicas = remote_tp // part.units
    readers_sharing_unit = max(1, local_tp // part.units)
    return unit * replicas + (local_rank % readers_sharing_unit) % replicas, 0


def map_part(part: ShardedPart, local_tp: int, local_rank: int, remote_tp: int) -> tuple[UnitRun, ...]:
    """The runs that fill every unit slot of `part` on reader rank `local_rank`."""
    if part.replicated:
        reader = local_rank * remote_tp // local_tp
        return (UnitRun(reader, 0, 0, part.units),)
    first = part.first_unit(local_rank, local_tp)
    runs: list[UnitRun] = []
    for slot in range(part.units_on_rank(local_tp)):
        src, remote_slot = _supplier(part, first + slot, local_tp, local_rank, remote_tp)
        prev = runs[-1] if runs else None
        if prev and prev.src_rank == src and prev.remote_slot + prev.count == remote_slot:
            runs[-1] = UnitRun(src, prev.local_slot, prev.remote_slot, prev.count + 1)
        else:
            runs.append(UnitRun(src, slot, remote_slot, 1))
    return tuple(runs)


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
    parts = model_parts(model).values()
    return tuple(
        frozenset(run.src_rank for part in parts for run in map_part(part, local_tp, rank, remote_tp))
        for rank in range(local_tp)
    )


def _notify_only(model: ModelSpec, local_tp: int, local_rank: int, remote_tp: int) -> tuple[int, ...]:
    """Source ranks no reader reads from are notified by reader `p * local_tp // remote_tp`."""
    read_by_anyone = frozenset().union(*_read_sources(model, local_tp, remote_tp))
    return tuple(
        p for p in range(remote_tp)
        if p not in read_by_anyone and p * local_tp // remote_tp == local_rank
    )


def compute_tp_mapping(model: ModelSpec, local_tp: int, local_rank: int, remote_tp: int) -> TPMapping:
    """The mapping for reader `local_rank` of a `local_tp` engine against a `remote_tp` engine."""
    if not 0 <= local_rank < local_tp or remote_tp <= 0:
        raise ValueError(f"bad ranks: local rank {local_rank} of TP {local_tp}, remote TP {remote_tp}")
    runs = {key: map_part(part, local_tp, local_rank, remote_tp) for key, part in model_parts(model).items()}
    return TPMapping(local_tp, local_rank, remote_tp, runs,
                     _notify_only(model, local_tp, local_rank, remote_tp))


def consumers_per_producer(model: ModelSpec, producer_tp: int, consumer_tp: int) -> tuple[int, ...]:
    """Notifications each producer (P) rank waits for per request: one per consumer rank that
    reads from it or is assigned to notify it. Every entry is at least 1."""
    counts = [0] * producer_tp
    for rank in range(consumer_tp):
        for p in compute_tp_mapping(model, consumer_tp, rank, producer_tp).notify_ranks:
            counts[p] += 1
    return tuple(counts)
