"""Hybrid prefix hits: cached attention blocks count only when a remote load brings the SSM state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlink.connector.api import ConnectorScheduler, RequestView, StepMetadata, WorkerOutput
from kvlink.engine.block_pool import BlockPool
from kvlink.engine.request import Request, RequestStatus, SamplingParams
from kvlink.engine.scheduler import Scheduler

BS = 4
PREFIX = list(range(1, 9))  # two full blocks


class Answers(ConnectorScheduler):
    """Answers each request with `answers[request_id]` (else `default`); records the calls."""

    def __init__(self, default: tuple[int, bool], **answers: tuple[int, bool]) -> None:
        self.default, self.answers = default, answers
        self.asked: list[tuple[str, int]] = []
        self.allocated: list[tuple[str, list[list[int]], int]] = []

    def on_new_request(self, request: RequestView) -> None: ...

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        self.asked.append((request.request_id, num_computed_tokens))
        return self.answers.get(request.request_id, self.default)

    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[Sequence[int]],
                                 num_external_tokens: int, num_computed_tokens: int) -> None:
        self.allocated.append((request.request_id, [list(b) for b in block_ids], num_computed_tokens))

    def build_step_metadata(self) -> StepMetadata:
        return StepMetadata()

    def update_connector_output(self, output: WorkerOutput) -> None: ...

    def request_finished(self, request: RequestView, block_ids: Sequence[Sequence[int]],
                         aborted: bool) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def shutdown(self) -> None: ...


def hybrid(num_blocks: int, connector: ConnectorScheduler | None) -> tuple[Scheduler, list[int]]:
    """A hybrid scheduler whose attention pool caches PREFIX in two free blocks (returned)."""
    pools = [BlockPool(num_blocks, BS), BlockPool(num_blocks, BS, enable_prefix_caching=False)]
    cached = pools[0].allocate(2)
    pools[0].cache_full_blocks(cached, PREFIX, len(PREFIX))
    pools[0].deallocate(cached)
    return Scheduler(pools, [False, True], connector), cached


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=4))


def test_full_hit_with_a_state_load_keeps_the_hits() -> None:
    connector = Answers((0, True))  # nothing beyond the hit, but P's state comes
    scheduler, cached = hybrid(8, connector)
    scheduler.add(request("d", [*PREFIX, 50]))
    assert scheduler.schedule().runs == []
    (parked,) = scheduler.parked.values()
    assert parked.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert parked.block_tables[0][:2] == cached and parked.num_computed_tokens == 8
    assert connector.asked == [("d", 8)] and connector.allocated[0][2] == 8
    assert scheduler.pools[1].blocks[parked.block_tables[1][0]].hash is None, "the state block is fresh"


def test_partial_hit_with_a_load_keeps_the_hits() -> None:
    connector = Answers((3, True))
    scheduler, cached = hybrid(8, connector)
    scheduler.add(request("d", [*PREFIX, 50, 51, 52, 53]))
    scheduler.schedule()
    (parked,) = scheduler.parked.values()
    assert parked.block_tables[0][:2] == cached and parked.num_computed_tokens == 8


def test_without_a_load_the_hits_are_dropped() -> None:
    """The attention blocks are cached but the SSM state after them is not: compute it all."""
    for connector in (Answers((0, False)), None):
        scheduler, _ = hybrid(8, connector)
        scheduler.add(request("local", [*PREFIX, 50]))
        (run,) = scheduler.schedule().runs
        assert (run.start_pos, run.num_tokens) == (0, 9)
        assert run.request.num_computed_tokens == 0


def test_waits_until_the_request_fits_without_its_hits() -> None:
    """The connector is asked once; if it says no load, the hits go, so room for all is needed."""
    connector = Answers((0, False), a=(1, True))
    scheduler, cached = hybrid(4, connector)
    scheduler.add(request("a", [*PREFIX, 60]))  # parked on the 2 cached blocks + 1 fresh one
    scheduler.schedule()
    assert scheduler.parked["a"].block_tables[0][:2] == cached
    assert [p.num_free_blocks for p in scheduler.pools] == [1, 3]
    connector.asked.clear()
    scheduler.add(request("b", [*PREFIX, 70]))  # fits on a's blocks (1 new), not without them (3)
    assert scheduler.schedule().runs == []
    assert connector.asked == [] and [r.request_id for r in scheduler.waiting] == ["b"]
