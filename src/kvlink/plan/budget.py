"""The memory a transfer plan's descriptor lists will take, computed before any is allocated.

A plan holds, for every source rank, a local and a remote list of `(addr, len, device)`
uint64 triples: one per (page, token chunk, piece) of every region it moves (a piece
is a head run, or with unequal kernel blocks one segment of one head's page order). Their
count follows from the geometries and the TP mapping alone, so an absurd pool size or
chunking is refused with the computed size instead of ending in a MemoryError.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from math import gcd

from kvlink.layout.geometry import WorkerGeometry
from kvlink.layout.limits import MAX_PLAN_BYTES
from kvlink.plan.tp_mapping import TPMapping, compute_tp_mapping

DESCRIPTOR_BYTES = 3 * 8


def descriptor_count(
    local: WorkerGeometry, remotes: Mapping[int, WorkerGeometry], mapping: TPMapping,
    sources: Iterable[int], chunk: int,
) -> int:
    """Descriptors (local and remote lists together) `build_transfer_plan` prepares for `sources`."""
    whole = local.kernel_block_size == next(iter(remotes.values())).kernel_block_size
    count = 0
    for src in sources:
        remote = remotes[src]
        l_chunks, r_chunks = local.kernel_block_size // chunk, remote.kernel_block_size // chunk
        for local_reg, remote_reg in zip(local.attention_regions, remote.attention_regions, strict=True):
            key = "kv" if local_reg.kind == "attention" else f"g{local_reg.group}.latent"
            runs = mapping.runs_from(key, src)
            segments = 1 if whole else len(local.token_segments(local_reg))
            pieces = len(runs) if whole else sum(run.count for run in runs) * segments
            count += pieces * (local_reg.num_pages * l_chunks + remote_reg.num_pages * r_chunks)
        for local_reg, remote_reg in zip(local.ssm_regions, remote.ssm_regions, strict=True):
            for sub in local_reg.sub_parts:
                runs = mapping.runs_from(f"g{local_reg.group}.{sub.name}", src)
                count += len(runs) * (local_reg.num_pages + remote_reg.num_pages)
    return count


def plan_bytes(local: WorkerGeometry, remotes: Mapping[int, WorkerGeometry]) -> int:
    """Bytes of the descriptor lists of `build_transfer_plan(local, remotes)` (pull: every source)."""
    any_remote = next(iter(remotes.values()))
    mapping = compute_tp_mapping(local.model, local.tp_size, local.tp_rank, any_remote.tp_size)
    chunk = gcd(local.kernel_block_size, any_remote.kernel_block_size)
    sources = [s for s in mapping.source_ranks if s in remotes]
    return DESCRIPTOR_BYTES * descriptor_count(local, remotes, mapping, sources, chunk)


ADVICE = ("use fewer or larger blocks (num_blocks, block_size), or kernel block sizes that are "
          "equal on P and D")


def check_plan_bytes(nbytes: int, what: str, limit: int = MAX_PLAN_BYTES, advice: str = ADVICE) -> None:
    """ValueError with the computed size when `nbytes` exceeds `limit`."""
    if nbytes > limit:
        raise ValueError(
            f"{what} needs {nbytes / 2**20:.1f} MiB of descriptor lists ({nbytes // DESCRIPTOR_BYTES} "
            f"descriptors of {DESCRIPTOR_BYTES} bytes), more than the bound of {limit / 2**20:.0f} MiB; "
            f"{advice}"
        )
