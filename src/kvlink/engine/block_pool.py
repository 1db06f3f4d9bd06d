"""Logical blocks of one KV-cache group: allocation, ref counts, prefix caching by chained hashes.

A block is either held (ref count > 0) or free. Free blocks sit in one LRU queue;
a free block that still carries a hash can be matched again until it is reused.
Invariant: a block id appears in at most one of {held, free}, and every hash in the
index names a block carrying exactly that hash.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

NO_HASH = None


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block given the hash of the block before it (None for the first)."""
    return hash((parent, tuple(token_ids)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = NO_HASH
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class BlockPool:
    """One KV-cache group's `num_blocks` logical blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest run of full leading blocks of `token_ids`.

        No reference is taken: pass the result to `allocate` before anything else allocates.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            chunk = tuple(token_ids[start : start + self.block_size])
            parent = chain_hash(parent, chunk)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, num_new_blocks: int, cached_block_ids: Sequence[int] = ()) -> bool:
        """Whether `allocate` can take refs on the cached blocks and hand out `num_new_blocks`."""
        revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        return num_new_blocks + revived <= self.num_free_blocks

    def allocate(self, num_new_blocks: int, cached_block_ids: Sequence[int] = ()) -> list[int]:
        """A block table: the cached blocks (ref count + 1) followed by fresh blocks."""
        if not self.can_allocate(num_new_blocks, cached_block_ids):
            raise RuntimeError(
                f"cannot allocate {num_new_blocks} blocks: {self.num_free_blocks} free; "
                "check can_allocate first"
            )
        for block_id in cached_block_ids:
            self._take(block_id)
        fresh = []
        for _ in range(num_new_blocks):
            block_id = next(iter(self.free))
            self._evict_hash(block_id)
            self._take(block_id)
            fresh.append(block_id)
        return list(cached_block_ids) + fresh

    def deallocate(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id; a block reaching zero becomes free (still matchable if hashed)."""
        for block_id in reversed(list(block_ids)):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is NO_HASH:  # reuse uncached blocks first, keep cached ones longest
                    self.free.move_to_end(block_id, last=False)

    def can_append(self, block_table: Sequence[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(block_table) <= self.num_free_blocks

    def may_append(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place so it covers `num_tokens` tokens."""
        missing = self.blocks_for(num_tokens) - len(block_table)
        if missing > 0:
            block_table.extend(self.allocate(missing))

    def cache_full_blocks(self, block_table: Sequence[int], token_ids: Sequence[int], num_valid: int) -> None:
        """Hash the full blocks among the first `num_valid` tokens, whose contents are now valid."""
        if not self.enable_prefix_caching:
            return
        parent: int | None = None
        for index in range(min(num_valid // self.block_size, len(block_table))):
            chunk = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent = chain_hash(parent, chunk)
            block = self.blocks[block_table[index]]
            if block.hash == parent:
                continue
            if block.hash is not NO_HASH or parent in self.hash_to_block:
                break  # another block already caches this prefix; stop the chain here
            block.hash, block.token_ids = parent, chunk
            self.hash_to_block[parent] = block.block_id

    def invalidate(self, block_ids: Iterable[int]) -> None:
        """Forget the hashes of blocks whose contents are not valid (a failed load)."""
        for block_id in block_ids:
            if 0 <= block_id < self.num_blocks:
                self._evict_hash(block_id)

    def check_integrity(self, holders: Iterable[Sequence[int]] | None = None) -> None:
        """Raise AssertionError unless free/held/hash bookkeeping is consistent.

        With `holders` (every block table that holds references), ref counts must
        equal the number of times each block appears in them.
        """
        held = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref count"
        assert not held & set(self.free), f"blocks both held and free: {sorted(held & set(self.free))}"
        assert len(held) + len(self.free) == self.num_blocks, "a block is neither held nor free (leak)"
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h, f"hash index names block {block_id} without that hash"
        hashed = {b.block_id for b in self.blocks if b.hash is not NO_HASH}
        assert hashed == set(self.hash_to_block.values()), "a hashed block is missing from the index"
        if holders is not None:
            counts = Counter(b for table in holders for b in table)
            wrong = {b.block_id: (b.ref_count, counts[b.block_id]) for b in self.blocks if b.ref_count != counts[b.block_id]}
            assert not wrong, f"ref counts differ from holders (block: (count, holders)): {wrong}"

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _evict_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not NO_HASH:
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = NO_HASH, ()
