"""Remote engines a worker talks to: handshake payloads in, prepared plans and handles out.

Everything here is computed once per remote engine (at handshake), so a request
only posts integer index arrays.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvlink.connector.digest_table import DigestSlots, table_descs
from kvlink.layout.conv_state import ConvTranspose, conv_transpose, planning_view
from kvlink.layout.digests import DigestGeometry, digest_geometry
from kvlink.layout.geometry import WorkerGeometry
from kvlink.plan.compat import IncompatibleLayout, check_compatible
from kvlink.plan.request import ReadSpec
from kvlink.plan.staged import StagedPlan, build_staged_plan, needs_staging, staging_geometry
from kvlink.plan.tp_mapping import compute_tp_mapping, consumers_per_producer
from kvlink.plan.transfer_plan import TransferPlan, build_transfer_plan
from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.wire import PROTOCOL_VERSION, HandshakePayload

if TYPE_CHECKING:
    from kvlink.connector.staging import StagingPool

MAX_GEOMETRY_BYTES = 1 << 20


def encode_geometry(geometry: WorkerGeometry) -> bytes:
    return msgspec.msgpack.encode(geometry.to_wire())


def decode_geometry(blob: bytes) -> WorkerGeometry:
    """Rebuild a peer's geometry from its handshake; refuse anything malformed."""
    if len(blob) > MAX_GEOMETRY_BYTES:
        raise IncompatibleLayout([f"peer geometry of {len(blob)} bytes exceeds {MAX_GEOMETRY_BYTES}"])
    try:
        wire = msgspec.msgpack.decode(blob)
        if not isinstance(wire, dict):
            raise TypeError("geometry is not a map")
        return WorkerGeometry.from_wire(wire)
    except (msgspec.DecodeError, TypeError, ValueError, KeyError) as exc:
        raise IncompatibleLayout([f"peer sent an unreadable geometry: {exc}"]) from None


@dataclass
class SourceHandles:
    """Prepared NIXL descriptor lists for one remote rank, paired by index."""

    agent_name: str
    local_handle: int
    remote_handle: int
    # Where the digest slice descriptors start in each list (after the KV ones); see
    # kvlink.connector.digest_table. -1: the source keeps no digests.
    digest_local_base: int = -1
    digest_remote_base: int = -1


@dataclass
class RemoteEngine:
    """A handshaked remote engine as seen by one local worker."""

    engine_id: str
    tp_size: int
    agents: dict[int, str]
    geometries: dict[int, WorkerGeometry]
    plan: TransferPlan | None
    handles: dict[int, SourceHandles]
    expected: tuple[int, ...]
    last_used: float = field(default_factory=time.monotonic)
    # Staged reads (different kernel block sizes, see kvlink.plan.staged): `plan` is then
    # `staged.read`, whose local side is the staging area of `pool`.
    staged: StagedPlan | None = None
    pool: StagingPool | None = None
    # P side (push): the reader's staging pages we write into are of this many tokens; 0: its own
    staged_tokens: int = 0
    # remote agent name -> its NIXL metadata (for the worker's notification agent)
    metadata: dict[str, bytes] = field(default_factory=dict)
    # source rank -> the slots its digest slices land in (sources that keep a digest table)
    digest_slots: dict[int, DigestSlots] = field(default_factory=dict)
    digest_geometries: dict[int, DigestGeometry] = field(default_factory=dict)
    # D side: the source keeps its SSM conv state in another layout; its loads land in that
    # layout (the plan's local side is our `planning_view`) and are re-laid out into ours
    conv: ConvTranspose | None = None

    def notify_agents(self, ranks: Iterable[int]) -> list[tuple[int, str]]:
        return [(r, self.agents[r]) for r in ranks if r in self.agents]


def conv_blocks(engine: RemoteEngine, specs: Sequence[ReadSpec]) -> tuple[ConvTranspose, dict[int, list[int]]] | None:
    """What re-lays out a load from `engine` once it is in: the state blocks its specs write in
    the SSM groups whose conv layout differs from ours (None when none does)."""
    if engine.conv is None:
        return None
    blocks = {g: sorted({int(b) for spec in specs for b in spec.local_blocks[g]}) for g in engine.conv.groups}
    return engine.conv, blocks


def check_payload(payload: HandshakePayload, local: WorkerGeometry, engine_id: str) -> WorkerGeometry:
    """Validate one rank's handshake payload against our own layout; return its geometry."""
    problems = []
    if payload.version != PROTOCOL_VERSION:
        problems.append(f"protocol version {payload.version} (we speak {PROTOCOL_VERSION})")
    if payload.engine_id != engine_id:
        problems.append(f"engine id {payload.engine_id!r} (expected {engine_id!r})")
    if problems:
        raise IncompatibleLayout(problems)
    geometry = decode_geometry(payload.geometry)
    if geometry.tp_rank != payload.tp_rank or geometry.tp_size != payload.tp_size:
        raise IncompatibleLayout([f"payload says rank {payload.tp_rank}/{payload.tp_size} but its "
                                  f"geometry is rank {geometry.tp_rank}/{geometry.tp_size}"])
    local = planning_view(local, geometry.model)  # another SSM conv layout: re-laid out on D
    check_compatible(geometry, local)
    if payload.compat_hash != local.model.compat_hash():
        raise IncompatibleLayout([f"model hash {payload.compat_hash} differs from ours "
                                  f"{local.model.compat_hash()}"])
    return geometry


StagingFor = Callable[[int], "StagingPool"]
DigestSlotsFor = Callable[[WorkerGeometry], DigestSlots]


def connect_reader(
    agent: NixlAgent, local: WorkerGeometry, engine_id: str, payloads: Mapping[int, HandshakePayload],
    staging_for: StagingFor | None = None, digest_slots_for: DigestSlotsFor | None = None,
) -> RemoteEngine:
    """D side (pull): we read from the remote engine. Plans, adds agents, preps lists.

    With `staging_for` (P kernel block size → the worker's staging pool), a P whose pages
    need a re-layout (`needs_staging`) is read through staging pages. With
    `digest_slots_for` (a source geometry → the worker's slots for its digest slices), the
    lists of a source that keeps a digest table end with its slices' descriptors."""
    geometries = {r: check_payload(p, local, engine_id) for r, p in payloads.items()}
    remote_tp = next(iter(payloads.values())).tp_size
    sources = {r: geometries[r] for r in _sources(local, remote_tp, geometries)}
    any_source = next(iter(sources.values()))
    own, local = local, planning_view(local, any_source.model)
    conv = conv_transpose(own, local)
    staged, pool = None, None
    if staging_for is not None and needs_staging(local, any_source):
        pool = staging_for(any_source.kernel_block_size)  # its SSM pages described in the source's conv layout
        staged = build_staged_plan(local, planning_view(pool.geometry, any_source.model), sources)
        plan = staged.read
    else:
        plan = build_transfer_plan(local, sources)
    agents = {r: agent.add_remote(p.agent_metadata) for r, p in payloads.items()}
    metadata = {agents[r]: p.agent_metadata for r, p in payloads.items()}
    handles: dict[int, SourceHandles] = {}
    slots: dict[int, DigestSlots] = {}
    try:
        for source in plan.sources:
            rank, name = source.src_rank, agents[source.src_rank]
            local_descs, remote_descs = source.local_descs, source.remote_descs
            table = payloads[rank].digest_table
            if digest_slots_for is not None and table:
                slots[rank] = digest_slots_for(geometries[rank])
                local_descs = np.concatenate([local_descs, slots[rank].descs()])
                remote_descs = np.concatenate([remote_descs, table_descs(geometries[rank], table)])
            handles[rank] = SourceHandles(name, agent.prep_local(local_descs),
                                          agent.prep_remote(name, remote_descs))
            if rank in slots:
                handles[rank].digest_local_base = len(source.local_descs)
                handles[rank].digest_remote_base = len(source.remote_descs)
    except Exception:
        release_engine(agent, RemoteEngine(engine_id, remote_tp, agents, geometries, plan, handles, ()))
        raise
    expected = consumers_per_producer(local.model, remote_tp, local.tp_size)
    return RemoteEngine(engine_id, remote_tp, agents, geometries, plan, handles, expected,
                        staged=staged, pool=pool, metadata=metadata, digest_slots=slots,
                        digest_geometries={rank: digest_geometry(geometries[rank]) for rank in slots},
                        conv=conv)


def _sources(local: WorkerGeometry, remote_tp: int, geometries: Mapping[int, WorkerGeometry]) -> list[int]:
    sources = compute_tp_mapping(local.model, local.tp_size, local.tp_rank, remote_tp).source_ranks
    missing = [r for r in sources if r not in geometries]
    if missing:
        raise IncompatibleLayout([f"no handshake payload for source ranks {missing}"])
    return list(sources)


def connect_writer(
    agent: NixlAgent, local: WorkerGeometry, engine_id: str, reader_rank: int, payload: HandshakePayload,
) -> RemoteEngine:
    """P side (push): we write into one D rank. The plan is the reader's, seen from its source.

    A reader that must re-lay out our pages (`needs_staging`) is written through the staging
    area it offers for our kernel block size: whole pages, as its staged reads land them."""
    # A reader with another SSM conv layout gets ours, and re-lays it out once we pushed.
    reader = planning_view(check_payload(payload, local, engine_id), local.model)
    target = reader
    if needs_staging(reader, local):
        target = writer_staging(reader, payload, local.kernel_block_size)
    plan = build_transfer_plan(target, {local.tp_rank: local}, only_sources=[local.tp_rank])
    name = agent.add_remote(payload.agent_metadata)
    (source,) = plan.sources
    local_handle = agent.prep_local(source.remote_descs)
    try:  # e.g. a staging area outside the memory the reader registered
        handles = {reader_rank: SourceHandles(name, local_handle, agent.prep_remote(name, source.local_descs))}
    except Exception:
        agent.release_dlist(local_handle)
        agent.remove_remote(name)
        raise
    return RemoteEngine(engine_id, payload.tp_size, {reader_rank: name}, {reader_rank: reader}, plan,
                        handles, (), staged_tokens=target.kernel_block_size if target is not reader else 0)


def writer_staging(reader: WorkerGeometry, payload: HandshakePayload, kernel_block_size: int) -> WorkerGeometry:
    """The staging area a reader offers for pages of `kernel_block_size` tokens, as a geometry
    (the reader's heads and page order, our kernel block size); refused when it offers none."""
    offered = [area for area in payload.staging if area[0] == kernel_block_size]
    if not offered:
        sizes = sorted(area[0] for area in payload.staging)
        raise IncompatibleLayout([
            f"reader rank {reader.tp_rank} re-lays out pages of another kernel block size "
            f"({kernel_block_size} here, {reader.kernel_block_size} there) but offers no staging "
            f"pages of {kernel_block_size} tokens (it offers {sizes or 'none'})"])
    _, slots, addrs = offered[0]
    if slots < 1 or len(addrs) != len(reader.regions):
        raise IncompatibleLayout([f"reader rank {reader.tp_rank} offers a staging area of {slots} pages "
                                  f"at {len(addrs)} layers; it has {len(reader.regions)}"])
    return staging_geometry(reader, kernel_block_size, slots, list(addrs))


def release_engine(agent: NixlAgent, engine: RemoteEngine) -> None:
    """Drop prepared lists and remote agents (after a failure, eviction or shutdown)."""
    for h in engine.handles.values():
        agent.release_dlist(h.local_handle)
    for name in set(engine.agents.values()):
        agent.remove_remote(name)
    engine.handles.clear()
