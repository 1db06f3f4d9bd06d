"""Per-request planning: block ids of both sides → descriptor index arrays, fully vectorized.

Token t of the request lives on P at kernel block `kernel(p_ids[t // bs_P])` offset
`t % kbs_P` and on D at `kernel(d_ids[(t - computed) // bs_D])` offset `t % kbs_D`,
each side with its own physical-per-logical. Attention moves token chunks of
`gcd(kbs_P, kbs_D)` tokens, so any block-size ratio and any D prefix hit work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvlink.layout.limits import MAX_TOKENS, TOKENS_OR_ZERO, check, int_range
from kvlink.layout.spec import SlidingWindow, is_ssm
from kvlink.plan.descriptors import IntArray, concat_descriptor_ids
from kvlink.plan.plan_types import AttentionSegment, PreparedPlan, SourcePlan


@dataclass(frozen=True, eq=False)
class ReadSpec:
    """One transfer from `src_rank`: post `local_descs[local_idx]` ↔ `remote_descs[remote_idx]`.

    `local_blocks[g]` are the reader's logical blocks of group g this transfer writes
    into: mark exactly those invalid if it fails.
    """

    src_rank: int
    local_idx: IntArray
    remote_idx: IntArray
    nbytes: int
    local_blocks: tuple[IntArray, ...]


@dataclass(frozen=True)
class _ChunkPositions:
    """Where each moved token chunk of one group sits: kernel block and chunk-in-block per side."""

    local_kernel: IntArray
    local_chunk: IntArray
    remote_kernel: IntArray
    remote_chunk: IntArray
    touched: IntArray


_EMPTY = np.zeros(0, dtype=np.int64)


def first_token_to_ship(plan: PreparedPlan, group_index: int, num_tokens: int, computed: int) -> int:
    """First token of a group that must move: after D's prefix hit, and for a sliding window
    group no earlier than the window before the next position (rounded down to a chunk)."""
    group = plan.local.model.groups[group_index]
    if isinstance(group, SlidingWindow):
        window_start = max(0, num_tokens - group.window) // plan.chunk_tokens * plan.chunk_tokens
        return max(computed, window_start)
    return computed


def _block_ids(ids: Sequence[int] | IntArray, side: str, group: int) -> IntArray:
    """One group's block ids as a flat int64 array; ValueError for anything but integers
    (bools, floats, strings, nested lists, values beyond int64)."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1:
        return ids
    what = f"{side} block ids of group {group}"
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise ValueError(f"{what} must be a sequence of integers, got {type(ids).__name__}")
    if isinstance(ids, (list, tuple)) and bool in set(map(type, ids)):
        raise ValueError(f"{what} must be integers, got a bool")
    try:
        array = np.asarray(ids)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{what} must be a flat sequence of integers: {exc}") from None
    if array.size == 0:
        return _EMPTY
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a flat sequence of integers (int64), got {array.dtype} "
                         f"values of shape {array.shape}")
    if array.dtype.kind == "u" and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what} must lie in int64, got {int(array.max())}")
    return array.astype(np.int64, copy=False)


def _check_distinct(ids: IntArray, side: str, group: int) -> None:
    """The blocks one request writes are distinct (two chunks never land in one block by accident)."""
    if ids.size > 1 and np.unique(ids).size != ids.size:
        raise ValueError(f"{side} block ids of group {group} repeat a block: {ids.tolist()[:16]}")


def _check_range(ids: IntArray, num_blocks: int, side: str, group: int) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"{side} block ids of group {group} must lie in [0, {num_blocks}); "
                         f"got range [{int(ids.min())}, {int(ids.max())}]")


def _check_length(ids: IntArray, needed: int, side: str, group: int, needed_tokens: str) -> None:
    # Before any array the size of the token range exists: a huge range with short lists is refused.
    if needed > ids.size:
        raise ValueError(f"{side} block list of group {group} has {ids.size} blocks but tokens "
                         f"{needed_tokens} need {needed}")


def _chunk_positions(
    plan: PreparedPlan, group: int, local_ids: IntArray, remote_ids: IntArray, start: int, end: int,
    computed: int,
) -> _ChunkPositions:
    c = plan.chunk_tokens
    span = f"[{start}, {end})"
    local = plan.local
    _check_length(local_ids, (end - 1 - computed) // local.block_size + 1, "local", group, span)
    _check_length(remote_ids, (end - 1) // plan.remote_block_size + 1, "remote", group, span)
    tokens = np.arange(start // c, -(-end // c), dtype=np.int64) * c
    local_block = (tokens - computed) // local.block_size
    local_logical = local_ids[local_block]
    remote_logical = remote_ids[tokens // plan.remote_block_size]
    _check_range(local_logical, local.num_blocks, "local", group)
    _check_range(remote_logical, plan.remote_num_blocks, "remote", group)
    local_in_logical = tokens % local.block_size
    remote_in_logical = tokens % plan.remote_block_size
    remote_ppl = plan.remote_block_size // plan.remote_kernel_block_size
    return _ChunkPositions(
        local_kernel=local_logical * local.physical_per_logical + local_in_logical // local.kernel_block_size,
        local_chunk=(local_in_logical % local.kernel_block_size) // c,
        remote_kernel=remote_logical * remote_ppl + remote_in_logical // plan.remote_kernel_block_size,
        remote_chunk=(remote_in_logical % plan.remote_kernel_block_size) // c,
        touched=local_ids[int(local_block[0]):int(local_block[-1]) + 1] if tokens.size else _EMPTY,
    )


def _segment_offsets(seg: AttentionSegment, pos: _ChunkPositions) -> tuple[IntArray, IntArray]:
    """Per-region offsets (block, chunk, piece) of every moved chunk, local and remote."""
    local_offsets = pos.local_kernel * seg.local_block_span + pos.local_chunk * seg.pieces
    remote_offsets = pos.remote_kernel * seg.remote_block_span + pos.remote_chunk * seg.pieces
    if seg.pieces > 1:
        piece = np.arange(seg.pieces, dtype=np.int64)
        local_offsets = (local_offsets[:, None] + piece[None, :]).reshape(-1)
        remote_offsets = (remote_offsets[:, None] + piece[None, :]).reshape(-1)
    return local_offsets, remote_offsets


def request_ids(
    plan: PreparedPlan,
    local_block_ids: Sequence[Sequence[int] | IntArray],
    remote_block_ids: Sequence[Sequence[int] | IntArray],
    num_tokens_to_ship: int,
    local_computed_tokens: int = 0,
    *,
    tokens: tuple[int, int] | None = None,
    layers: Sequence[int] | None = None,
) -> list[ReadSpec]:
    """Descriptor indices for one request, one ReadSpec per source rank of the plan.

    `local_block_ids[g]`: the reader's logical blocks of group g from token
    `local_computed_tokens` on (its newly allocated tail). `remote_block_ids[g]`: the
    source's full logical list from token 0. `num_tokens_to_ship` = prompt length - 1.
    SSM groups move only the state in the last block of each list, and move it whenever
    `num_tokens_to_ship > 0`, even when D's prefix hit covers every token: D's cached
    attention blocks do not give it the state after those tokens.

    A layerwise write moves a part of that, and the parts of one request are disjoint:
    `tokens=(start, end)` keeps the attention chunks whose first token lies in
    `[start, end)` (each a multiple of `plan.chunk_tokens` or `num_tokens_to_ship`),
    and leaves the SSM state out unless the range is non-empty and ends at
    `num_tokens_to_ship` (the state is final only then, and goes once); `layers` keeps only
    the regions of those model layers.
    """
    model = plan.local.model
    num_groups = len(model.groups)
    if len(local_block_ids) != num_groups or len(remote_block_ids) != num_groups:
        raise ValueError(f"expected block ids for {num_groups} groups, got {len(local_block_ids)} "
                         f"local and {len(remote_block_ids)} remote")
    check("local_computed_tokens", local_computed_tokens, TOKENS_OR_ZERO)
    if local_computed_tokens % plan.local.block_size:
        raise ValueError(f"local_computed_tokens {local_computed_tokens} must be a non-negative "
                         f"multiple of the local block size {plan.local.block_size}")
    check("num_tokens_to_ship", num_tokens_to_ship, TOKENS_OR_ZERO)
    num_tokens_to_ship, local_computed_tokens = int(num_tokens_to_ship), int(local_computed_tokens)
    lo, hi, with_state = _token_window(plan, num_tokens_to_ship, tokens)
    keep = None if layers is None else _layers(layers, model.num_layers)
    local_ids = [_block_ids(ids, "local", g) for g, ids in enumerate(local_block_ids)]
    remote_ids = [_block_ids(ids, "remote", g) for g, ids in enumerate(remote_block_ids)]
    positions: dict[int, _ChunkPositions] = {}
    state_blocks: dict[int, tuple[int, int]] = {}
    for g, group in enumerate(model.groups):
        if is_ssm(group):
            if num_tokens_to_ship > 0 and with_state:
                state_blocks[g] = _state_blocks(plan, g, local_ids[g], remote_ids[g])
            continue
        start = max(lo, first_token_to_ship(plan, g, num_tokens_to_ship, local_computed_tokens))
        end = min(hi, num_tokens_to_ship)
        if start < end:
            positions[g] = _chunk_positions(plan, g, local_ids[g], remote_ids[g], start,
                                            end, local_computed_tokens)
            if not isinstance(group, SlidingWindow):  # vLLM may list its null block more than once there
                _check_distinct(positions[g].touched, "local", g)
    return [_source_read(source, positions, state_blocks, num_groups, keep) for source in plan.sources]


def _token_window(plan: PreparedPlan, num_tokens: int, tokens: tuple[int, int] | None) -> tuple[int, int, bool]:
    """(start, end, with SSM state) of a part of the request; the whole request when None."""
    if tokens is None:
        return 0, num_tokens, True
    if not isinstance(tokens, (tuple, list)) or len(tokens) != 2:
        raise ValueError(f"tokens must be a (start, end) pair, got {tokens!r}"[:200])
    start, end = (int(check(f"tokens[{i}]", t, int_range(0, MAX_TOKENS))) for i, t in enumerate(tokens))
    c = plan.chunk_tokens
    if not 0 <= start <= end <= num_tokens:
        raise ValueError(f"token range [{start}, {end}) must lie in [0, {num_tokens}]")
    if (start % c and start != num_tokens) or (end % c and end != num_tokens):
        raise ValueError(f"token range [{start}, {end}) must start and end on chunks of {c} tokens "
                         f"(or end at {num_tokens})")
    return start, end, start < end == num_tokens  # the state goes once: with the part that ends the prompt


def _layers(layers: Sequence[int], num_layers: int) -> IntArray:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, np.ndarray)):
        raise ValueError(f"layers must be a sequence of layer indices, got {type(layers).__name__}")
    for layer in layers:
        check("layers", layer, int_range(0, num_layers - 1))
    return np.asarray(sorted({int(layer) for layer in layers}), dtype=np.int64)


def _state_blocks(plan: PreparedPlan, g: int, local_ids: IntArray, remote_ids: IntArray) -> tuple[int, int]:
    if not local_ids.size or not remote_ids.size:
        raise ValueError(f"SSM group {g} needs a state block on both sides; got {local_ids.size} "
                         f"local and {remote_ids.size} remote")
    local_block, remote_block = local_ids[-1:], remote_ids[-1:]
    _check_range(local_block, plan.local.num_blocks, "local", g)
    _check_range(remote_block, plan.remote_num_blocks, "remote", g)
    return int(local_block[0]), int(remote_block[0])


def _of_layers(layers: IntArray | None, entry_layers: IntArray, local_starts: IntArray, remote_starts: IntArray,
               entry_bytes: IntArray, total_bytes: int) -> tuple[IntArray, IntArray, int] | None:
    """A segment's region starts (and bytes per unit) kept for `layers` (all when None);
    None when it has none of them."""
    if layers is None:
        return local_starts, remote_starts, total_bytes
    mask = np.isin(entry_layers, layers)
    if not mask.any():
        return None
    return local_starts[mask], remote_starts[mask], int(entry_bytes[mask].sum())


def _source_read(source: SourcePlan, positions: dict[int, _ChunkPositions],
                 state_blocks: dict[int, tuple[int, int]], num_groups: int,
                 layers: IntArray | None = None) -> ReadSpec:
    local_parts: list[tuple[IntArray, IntArray]] = []
    remote_parts: list[tuple[IntArray, IntArray]] = []
    touched: list[IntArray] = [_EMPTY] * num_groups
    nbytes = 0
    for seg in source.attention:
        pos = positions.get(seg.group)
        if pos is None:
            continue
        picked = _of_layers(layers, seg.layers, seg.local_region_starts, seg.remote_region_starts,
                            seg.region_chunk_bytes, seg.chunk_bytes)
        if picked is None:
            continue
        local_starts, remote_starts, chunk_bytes = picked
        local_offsets, remote_offsets = _segment_offsets(seg, pos)
        local_parts.append((local_starts, local_offsets))
        remote_parts.append((remote_starts, remote_offsets))
        touched[seg.group] = pos.touched
        nbytes += chunk_bytes * pos.local_kernel.size
    for ssm in source.ssm:
        if ssm.group not in state_blocks:
            continue
        local_block, remote_block = state_blocks[ssm.group]
        picked = _of_layers(layers, ssm.layers, ssm.local_starts, ssm.remote_starts, ssm.piece_bytes, ssm.block_bytes)
        if picked is None:
            continue
        local_starts, remote_starts, block_bytes = picked
        local_parts.append((local_starts, np.array([local_block], dtype=np.int64)))
        remote_parts.append((remote_starts, np.array([remote_block], dtype=np.int64)))
        touched[ssm.group] = np.array([local_block], dtype=np.int64)
        nbytes += block_bytes
    return ReadSpec(
        src_rank=source.src_rank,
        local_idx=concat_descriptor_ids(local_parts),
        remote_idx=concat_descriptor_ids(remote_parts),
        nbytes=nbytes,
        local_blocks=tuple(touched),
    )
