"""Where the new tokens of a batch of sequences go: rows of the flat batch, positions, cache slots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedSequence:
    """One sequence's new tokens: rows `[first_row, first_row + num_new)` of the flat batch."""

    first_row: int
    num_new: int
    start_pos: int
    kernel_block_table: torch.Tensor

    @property
    def rows(self) -> slice:
        return slice(self.first_row, self.first_row + self.num_new)

    @property
    def num_tokens(self) -> int:
        """Tokens with K/V once this step has written its own."""
        return self.start_pos + self.num_new


@dataclass(frozen=True)
class PagedBatch:
    """The new tokens of several sequences laid out back to back.

    `positions`, `slot_blocks` and `slot_offsets` have one entry per row, so
    RoPE and the cache write run once for the whole batch; attention runs
    per sequence because each has its own pages.
    """

    sequences: tuple[PagedSequence, ...]
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor

    @property
    def last_rows(self) -> torch.Tensor:
        return torch.tensor([s.first_row + s.num_new - 1 for s in self.sequences])

    @classmethod
    def build(
        cls,
        num_new: Sequence[int],
        start_positions: Sequence[int],
        kernel_block_tables: Sequence[torch.Tensor],
        kernel_block_size: int,
    ) -> PagedBatch:
        sequences, positions, blocks = [], [], []
        first_row = 0
        for count, start, table in zip(num_new, start_positions, kernel_block_tables, strict=True):
            table = table.to(torch.int64)
            seq_positions = torch.arange(start, start + count)
            sequences.append(PagedSequence(first_row, count, start, table))
            positions.append(seq_positions)
            blocks.append(table[seq_positions // kernel_block_size])
            first_row += count
        flat_positions = torch.cat(positions)
        return cls(
            sequences=tuple(sequences),
            positions=flat_positions,
            slot_blocks=torch.cat(blocks),
            slot_offsets=flat_positions % kernel_block_size,
        )
