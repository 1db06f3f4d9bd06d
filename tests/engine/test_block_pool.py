"""Block pool: prefix caching, ref counts, LRU reuse, invalidation, and integrity under random use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink.engine.block_pool import BlockPool

BS = 4


def _admit(pool: BlockPool, tokens: list[int]) -> list[int]:
    hits = pool.match_prefix(tokens)
    table = pool.allocate(pool.blocks_for(len(tokens)) - len(hits), hits)
    pool.cache_full_blocks(table, tokens, len(tokens))
    return table


def test_shared_prefix_reuses_blocks_and_counts_refs() -> None:
    pool = BlockPool(8, BS)
    first = _admit(pool, list(range(10)))
    second = _admit(pool, [*range(8), 99, 98, 97])
    assert second[:2] == first[:2] and second[2] != first[2]
    assert [pool.blocks[b].ref_count for b in first] == [2, 2, 1]
    assert pool.num_free_blocks == 8 - 4
    pool.check_integrity([first, second])
    pool.deallocate(first)
    pool.deallocate(second)
    assert pool.num_free_blocks == 8
    pool.check_integrity([])


def test_freed_cached_blocks_stay_matchable_until_reused() -> None:
    pool = BlockPool(4, BS)
    table = _admit(pool, list(range(8)))
    pool.deallocate(table)
    assert pool.match_prefix(list(range(8))) == table
    pool.allocate(4)  # takes every block, evicting the cached ones
    assert pool.match_prefix(list(range(8))) == []


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4, BS)
    cached = _admit(pool, list(range(4)))
    partial = pool.allocate(1)
    pool.deallocate(cached)
    pool.deallocate(partial)
    pool.allocate(1)
    assert pool.match_prefix(list(range(4))) == cached


def test_invalidate_drops_the_hash_but_not_the_reference() -> None:
    pool = BlockPool(4, BS)
    table = _admit(pool, list(range(8)))
    pool.invalidate([table[1]])
    assert pool.match_prefix(list(range(8))) == table[:1]
    assert pool.blocks[table[1]].ref_count == 1
    pool.check_integrity([table])


def test_prefix_caching_off_never_matches() -> None:
    pool = BlockPool(4, BS, enable_prefix_caching=False)
    table = _admit(pool, list(range(8)))
    assert pool.match_prefix(list(range(8))) == []
    pool.deallocate(table)
    assert pool.num_free_blocks == 4


def test_append_grows_only_when_a_block_fills() -> None:
    pool = BlockPool(3, BS)
    table = pool.allocate(1)
    pool.may_append(table, 4)
    assert len(table) == 1
    pool.may_append(table, 5)
    assert len(table) == 2
    assert pool.can_append(table, 12) and not pool.can_append(table, 13)


def test_overdrawing_is_refused() -> None:
    pool = BlockPool(2, BS)
    with pytest.raises(RuntimeError, match="cannot allocate 3 blocks"):
        pool.allocate(3)
    table = pool.allocate(1)
    pool.deallocate(table)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.deallocate(table)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.lists(st.integers(0, 2), min_size=1, max_size=14)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("append"), st.integers(0, 50)),
        st.tuples(st.just("invalidate"), st.lists(st.integers(0, 11), max_size=3)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_random_use_keeps_integrity_and_frees_everything(ops: list[tuple[str, object]]) -> None:
    pool = BlockPool(12, BS)
    live: list[tuple[list[int], list[int]]] = []  # (block table, tokens)
    for op, arg in ops:
        if op == "admit":
            tokens = list(arg)  # type: ignore[call-overload]
            hits = pool.match_prefix(tokens)
            need = pool.blocks_for(len(tokens)) - len(hits)
            if pool.can_allocate(need, hits):
                table = pool.allocate(need, hits)
                pool.cache_full_blocks(table, tokens, len(tokens))
                live.append((table, tokens))
        elif op == "free" and live:
            table, _ = live.pop(int(arg) % len(live))  # type: ignore[call-overload]
            pool.deallocate(table)
        elif op == "append" and live:
            table, tokens = live[int(arg) % len(live)]  # type: ignore[call-overload]
            tokens.append(1)
            if pool.can_append(table, len(tokens)):
                pool.may_append(table, len(tokens))
                pool.cache_full_blocks(table, tokens, len(tokens))
            else:
                tokens.pop()
        elif op == "invalidate":
            pool.invalidate(arg)  # type: ignore[arg-type]
        pool.check_integrity([t for t, _ in live])
        for table, tokens in live:
            assert len(table) == pool.blocks_for(len(tokens))
            for index, block_id in enumerate(table):  # a shared block holds this request's tokens
                cached = pool.blocks[block_id].token_ids
                assert not cached or list(cached) == tokens[index * BS : (index + 1) * BS]
    for table, _ in live:
        pool.deallocate(table)
    pool.check_integrity([])
    assert pool.num_free_blocks == 12
