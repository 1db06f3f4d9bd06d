"""Scheduler: FIFO admission while blocks allow, one SSM block per request, preemption of the newest."""

from __future__ import annotations

from kvlink.engine.block_pool import BlockPool
from kvlink.engine.request import Request, RequestStatus, SamplingParams
from kvlink.engine.scheduler import Scheduler

BS = 4


def make(num_blocks: int, hybrid: bool = True, **kwargs: int) -> Scheduler:
    groups = [False, True] if hybrid else [False]
    pools = [BlockPool(num_blocks, BS, enable_prefix_caching=not s) for s in groups]
    return Scheduler(pools, groups, None, **kwargs)


def request(request_id: str, length: int) -> Request:
    return Request(request_id, list(range(1, length + 1)), SamplingParams(max_tokens=100))


def decode(scheduler: Scheduler, steps: int) -> None:
    """Pretend every running request computed its tokens and sampled one more."""
    for _ in range(steps):
        out = scheduler.schedule()
        for run in out.runs:
            run.request.num_computed_tokens = run.start_pos + run.num_tokens
            run.request.output_token_ids.append(0)


def test_admits_in_order_until_blocks_run_out() -> None:
    scheduler = make(num_blocks=4)
    for i, length in enumerate([8, 8, 4]):  # 2 + 2 + 1 attention blocks, one SSM block each
        scheduler.add(request(f"r{i}", length))
    out = scheduler.schedule()
    assert [(r.request.request_id, r.start_pos, r.num_tokens) for r in out.runs] == [("r0", 0, 8), ("r1", 0, 8)]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    assert [len(t) for t in scheduler.running[0].block_tables] == [2, 1]
    assert [p.num_free_blocks for p in scheduler.pools] == [0, 2]


def test_waiting_head_blocks_later_requests() -> None:
    scheduler = make(num_blocks=3)
    scheduler.add(request("big", 9))  # 3 blocks
    scheduler.add(request("blocked", 12))
    scheduler.add(request("small", 1))
    out = scheduler.schedule()
    assert [r.request.request_id for r in out.runs] == ["big"]
    assert [r.request_id for r in scheduler.waiting] == ["blocked", "small"]


def test_decode_grows_by_one_block_at_boundaries() -> None:
    scheduler = make(num_blocks=8)
    scheduler.add(request("a", 4))
    decode(scheduler, 1)  # prefill 4 tokens, sample token 5
    out = scheduler.schedule()
    assert [(r.start_pos, r.num_tokens) for r in out.runs] == [(4, 1)]
    assert [len(t) for t in scheduler.running[0].block_tables] == [2, 1]


def test_out_of_blocks_preempts_newest_and_requeues_it_first() -> None:
    scheduler = make(num_blocks=2)
    scheduler.add(request("old", 4))
    scheduler.add(request("new", 4))
    scheduler.add(request("later", 1))
    decode(scheduler, 1)  # both admitted with one block per group; "later" waits
    out = scheduler.schedule()  # both need a 2nd block, only one is free
    assert [r.request_id for r in out.preempted] == ["new"]
    assert [r.request.request_id for r in out.runs] == ["old"]
    preempted = out.preempted[0]
    assert preempted.status is RequestStatus.WAITING and preempted.num_computed_tokens == 0
    assert preempted.block_tables == []
    assert [r.request_id for r in scheduler.waiting] == ["new", "later"]
    assert preempted.output_token_ids == [0]  # kept: recomputed with the prompt when readmitted
    for group, pool in enumerate(scheduler.pools):
        pool.check_integrity([r.block_tables[group] for r in scheduler.running])


def test_readmitted_request_recomputes_prompt_and_outputs() -> None:
    scheduler = make(num_blocks=4)
    scheduler.add(request("a", 3))
    decode(scheduler, 2)
    a = scheduler.running[0]
    scheduler.preempt(a)
    out = scheduler.schedule()
    assert [(r.start_pos, r.num_tokens) for r in out.runs] == [(0, 5)]


def test_max_num_seqs_caps_the_batch() -> None:
    scheduler = make(num_blocks=16, max_num_seqs=2)
    for i in range(3):
        scheduler.add(request(f"r{i}", 2))
    assert len(scheduler.schedule().runs) == 2
    assert len(scheduler.waiting) == 1


def test_token_budget_defers_prefills_but_never_starves_one() -> None:
    scheduler = make(num_blocks=16, max_num_batched_tokens=10)
    scheduler.add(request("long", 12))
    scheduler.add(request("next", 4))
    out = scheduler.schedule()
    assert [r.request.request_id for r in out.runs] == ["long"]
    assert [r.request_id for r in scheduler.waiting] == ["next"]


def test_request_that_can_never_fit_is_rejected_not_stuck() -> None:
    scheduler = make(num_blocks=2)
    scheduler.add(request("huge", 9))
    scheduler.add(request("ok", 2))
    out = scheduler.schedule()
    assert [r.request_id for r in out.rejected] == ["huge"]
    assert "raise num_blocks" in (out.rejected[0].error or "")
    assert [r.request.request_id for r in out.runs] == ["ok"]


def test_attention_only_model_uses_prefix_hits_but_leaves_a_token() -> None:
    scheduler = make(num_blocks=8, hybrid=False)
    first = request("first", 8)
    scheduler.add(first)
    decode(scheduler, 1)
    pool = scheduler.pools[0]
    pool.cache_full_blocks(first.block_tables[0], first.all_token_ids, 8)
    scheduler.add(request("same", 8))  # both blocks cached, but the last token must be recomputed
    scheduler.add(request("longer", 10))
    out = scheduler.schedule()
    runs = {r.request.request_id: (r.start_pos, r.num_tokens) for r in out.runs}
    assert runs["same"] == (4, 4) and runs["longer"] == (8, 2)
    same = next(r for r in scheduler.running if r.request_id == "same")
    assert same.block_tables[0][0] == first.block_tables[0][0]


def test_hybrid_model_never_uses_local_prefix_hits() -> None:
    scheduler = make(num_blocks=8)
    first = request("first", 8)
    scheduler.add(first)
    decode(scheduler, 1)
    scheduler.pools[0].cache_full_blocks(first.block_tables[0], first.all_token_ids, 8)
    scheduler.add(request("same", 8))
    out = scheduler.schedule()
    assert [(r.start_pos, r.num_tokens) for r in out.runs if r.request.request_id == "same"] == [(0, 8)]
