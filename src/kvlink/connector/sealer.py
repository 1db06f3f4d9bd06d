"""P side of KV integrity: seal each finished request's shipped blocks into the digest table.

Also the test-only fault injector. `KVLINK_TEST_FAULT` in the worker's environment (never
a request, an option or a config file) names faults that tests inject on purpose, to prove
that corrupted KV is caught; a worker that reads it says so in its log:

* `flip_after_seal` (P): after sealing a request, flip one byte of its first shipped unit;
* `free_after_seal` (P): free the request's blocks at once, as if its lease had run out,
  while the params D gets still claim the whole lease (the engine may reuse the blocks);
* `skip_descriptor` (D): leave one KV descriptor out of every READ (a truncated transfer).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from kvlink.connector.digest_table import DigestTable
from kvlink.connector.integrity import Memory
from kvlink.connector.stats import ConnectorStats
from kvlink.layout.digests import shipped_blocks, unit_ranges

FAULT_ENV = "KVLINK_TEST_FAULT"
FAULTS = ("flip_after_seal", "free_after_seal", "skip_descriptor")
log = logging.getLogger("kvlink.connector.integrity")


@dataclass(frozen=True)
class Faults:
    flip_after_seal: bool = False
    free_after_seal: bool = False
    skip_descriptor: bool = False

    @classmethod
    def from_env(cls) -> Faults:
        names = {n.strip() for n in os.environ.get(FAULT_ENV, "").split(",") if n.strip()}
        unknown = names - set(FAULTS)
        if unknown:
            raise ValueError(f"{FAULT_ENV}: unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
        if names:
            log.warning("TEST FAULTS INJECTED (%s=%s): this worker corrupts KV on purpose", FAULT_ENV,
                        ",".join(sorted(names)))
        return cls(**{name: True for name in names})


EARLY_SEALS_KEPT = 4096  # early seals whose save has not come yet (an aborted request's never does)


def _seal_key(entry: dict[str, Any]) -> tuple[int, tuple[tuple[int, ...], ...]]:
    return int(entry.get("num_tokens", 0)), tuple(tuple(int(b) for b in ids) for ids in entry["block_ids"])


class Sealer:
    """Seals the requests a P worker keeps for decoders (`saves` of a step).

    Inside vLLM a request's save reaches the worker one engine step after its prefill, after
    that step's forward: D, already holding P's answer, would find the digests missing for a
    whole forward pass. So vLLM's scheduler also names the requests whose prefill a step
    completes (`StepMetadata.seals`) and the worker seals them right after that forward
    (`seal_early`); their save then finds them sealed over the same blocks and tokens, and
    only the fault injector runs."""

    def __init__(self, table: DigestTable, memory: Memory, stats: ConnectorStats, faults: Faults) -> None:
        self.table = table
        self.memory = memory
        self.stats = stats
        self.faults = faults
        self._early: dict[str, tuple[int, tuple[tuple[int, ...], ...]]] = {}

    def _hash(self, entry: dict[str, Any]) -> None:
        hashed = self.table.seal(self.memory, entry["block_ids"], entry["token_ids"], int(entry["num_tokens"]))
        self.stats.count("kv_sealed_bytes_total", hashed)

    def seal_early(self, entry: dict[str, Any]) -> None:
        """Seal a request whose prefill the forward just completed, before its save."""
        if not entry.get("token_ids") or int(entry.get("num_tokens", 0)) <= 0:
            return
        self._hash(entry)
        self.stats.count("kv_early_seals_total")
        self._early[entry["request_id"]] = _seal_key(entry)
        while len(self._early) > EARLY_SEALS_KEPT:
            del self._early[next(iter(self._early))]

    def seal(self, save: dict[str, Any]) -> bool:
        """Seal one save; True when the fault injector wants its blocks freed at once."""
        tokens, num_tokens = save.get("token_ids"), int(save.get("num_tokens", 0))
        if not tokens or num_tokens <= 0:
            return False
        if self._early.pop(save["request_id"], None) != _seal_key(save):
            self._hash(save)
        if self.faults.flip_after_seal:
            self._flip(save["block_ids"], num_tokens)
        return self.faults.free_after_seal

    def _flip(self, block_ids: list[list[int]], num_tokens: int) -> None:
        geometry = self.table.geometry
        for group in range(len(geometry.model.groups)):
            ids = block_ids[group] if group < len(block_ids) else []
            indices = list(shipped_blocks(geometry, group, num_tokens, len(ids)))
            if not indices or ids[indices[0]] < 0:
                continue
            ranges = unit_ranges(self.table.digests, group, [ids[indices[0]]], [indices[0]], num_tokens)
            if not ranges.units or not ranges.lengths[0]:
                continue
            addr, length = int(ranges.addrs[0]), int(ranges.lengths[0])
            view = self.memory(addr, length)
            view[length // 2] ^= 0x5A
            log.warning("TEST FAULT flip_after_seal: flipped byte %#x of group %d block %d", addr + length // 2,
                        group, ids[indices[0]])
            return
