"""Layerwise mode, P side: what one D rank's push request has been written so far, per layer.

D asks first (its push request reaches P while P may still be queueing or prefilling the
request). After every layer of every forward of that prefill, P writes the layer's token
chunks that are now complete and not yet written (`tokens_ready`); when the prefill ends
and those writes have landed, one last WRITE carries the rest (the prompt's tail chunk,
the SSM state) with `pushed`. Parts never overlap, so no byte of D's is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stream:
    """A P request in layerwise mode, as the scheduler side announced it."""

    request_id: str
    prompt_hash: str
    num_tokens: int  # prompt length - 1: what P computes and ships
    key: str  # what D calls it: the id the proxy gave P and D (P's own id unless renamed)


@dataclass
class LayerProgress:
    """Per model layer, the first token not yet written (D's prefix hit and a sliding window
    are applied by the planner on top: it never moves tokens before those)."""

    sent: list[int]
    inflight: int = 0
    failed: bool = False
    writes: int = 0
    bytes: int = 0

    @classmethod
    def start(cls, num_layers: int) -> LayerProgress:
        return cls([0] * num_layers)

    def remainder(self) -> list[tuple[int, list[int]]]:
        """(first unwritten token, layers) for the final write, layers grouped by progress."""
        by_start: dict[int, list[int]] = {}
        for layer, start in enumerate(self.sent):
            by_start.setdefault(start, []).append(layer)
        return sorted(by_start.items())


def tokens_ready(computed: int, num_tokens: int, chunk_tokens: int) -> int:
    """End of the tokens a layerwise write may move once `computed` tokens exist: whole
    chunks only (a chunk's tail may not be computed yet), all of them once the prefill is
    through (`num_tokens`)."""
    if computed >= num_tokens:
        return num_tokens
    return computed // chunk_tokens * chunk_tokens
