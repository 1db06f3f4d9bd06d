"""Staged reads over real NIXL in one process: P and D workers with different kernel block
sizes in vLLM's CPU page order; D reads whole P pages into staging and re-lays them out."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import sim
from kvmem import real_worker, region_sizes
from test_worker_inprocess import poll_until

from kvlink.connector.api import StepMetadata
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.worker import NixlWorker
from kvlink.layout.spec import FullAttention, ModelSpec

pytestmark = pytest.mark.timeout(90)
ORDER = "vllm_cpu_vec"


def _model(layers: int) -> ModelSpec:
    return ModelSpec("smol-like", 3, 64, "float32", (FullAttention(),), (0,) * layers)


class Pair:
    def __init__(self, p_kbs: int, d_kbs: int, layers: int = 4, staging_mib: int = 256,
                 p_blocks: int = 64, d_blocks: int = 64, p_config: dict[str, float] | None = None,
                 **d_config: float) -> None:
        self.model = _model(layers)
        self.p_kbs, self.d_kbs = p_kbs, d_kbs
        self.p_mem = real_worker(self.model, 1, 0, p_kbs, p_kbs, p_blocks, seed=1, page_order=ORDER)
        self.d_mem = real_worker(self.model, 1, 0, d_kbs, d_kbs, d_blocks, seed=2, page_order=ORDER)
        self.p = NixlWorker(ConnectorConfig("P", side_channel_port=0, **(p_config or {})), self.model, 1, 0, p_kbs, p_kbs,
                            p_blocks, page_order=ORDER)
        self.d = NixlWorker(ConnectorConfig("D", side_channel_port=0, staging_mib=staging_mib,
                                            stall_timeout_s=3.0, **d_config), self.model, 1, 0, d_kbs, d_kbs,
                            d_blocks, page_order=ORDER)
        self.p.register_kv_caches(*region_sizes(self.p_mem))
        self.d.register_kv_caches(*region_sizes(self.d_mem))
        self.rng = np.random.default_rng(7)
        self.free_p = list(self.rng.permutation(p_blocks))  # disjoint blocks per request
        self.free_d = list(self.rng.permutation(d_blocks))

    def close(self) -> None:
        self.d.shutdown()
        self.p.shutdown()

    def request(self, rid: str, shipped: int, computed: int = 0, mode: str = "pull",
                p_ids: np.ndarray | None = None, d_ids: np.ndarray | None = None, save: bool = True) -> dict:
        prompt = shipped + 1
        if p_ids is None:
            p_ids = np.array([self.free_p.pop() for _ in range(-(-prompt // self.p_kbs))], dtype=np.int64)
        if d_ids is None:
            d_ids = np.array([self.free_d.pop() for _ in range(-(-prompt // self.d_kbs))], dtype=np.int64)
        logical = sim.make_logical(self.model, shipped, self.rng)
        sim.store(self.p_mem, logical, [p_ids], [np.arange(shipped)])
        if save:
            self.p.start_load_kv(StepMetadata(saves=[{"request_id": f"p-{rid}", "block_ids": [p_ids.tolist()]}]))
        tail = d_ids[computed // self.d_kbs:]
        assert computed % self.d_kbs == 0
        return {
            "entry": {
                "request_id": rid, "remote_request_id": f"p-{rid}", "remote_engine_id": "P",
                "remote_host": "127.0.0.1", "remote_port": self.p.side_channel_port, "remote_tp_size": 1,
                "remote_block_ids": [p_ids.tolist()], "transfer_mode": mode,
                "local_block_ids": [d_ids.tolist()], "local_computed_tokens": computed,
                "num_tokens": shipped,
            },
            "logical": logical, "tail": tail, "shipped": shipped, "computed": computed, "p_ids": p_ids,
        }

    def layerwise(self, shipped: int, computed: int = 0, d_prompt_hash: str = "h") -> dict:
        """Request "lw": P starts prefilling it as a stream (prompt hash "h"), and D asks first,
        for `d_prompt_hash`'s prompt (the request's dict, as `request`)."""
        req = self.request("lw", shipped, computed=computed, mode="layerwise", save=False)
        req["entry"].update(remote_block_ids=[[]], prompt_hash=d_prompt_hash)
        self.p.start_load_kv(StepMetadata(streams=[{"request_id": "p-lw", "prompt_hash": "h",
                                                    "num_tokens": shipped}]))
        self.d.start_load_kv(StepMetadata(loads=[req["entry"]]))
        return req

    def check(self, req: dict) -> None:
        tokens = [np.arange(req["computed"], req["shipped"])]
        got = sim.load(self.d_mem, [req["tail"]], tokens, req["computed"])
        want = sim.expected_for(self.d_mem, req["logical"], tokens)
        for layer, rows in want.rows.items():
            np.testing.assert_array_equal(got.rows[layer], rows, err_msg=f"layer {layer}")


def _assert_no_push_completion(outs: list) -> None:
    """D failed request "lw" at its deadline: P never said `pushed`."""
    failure = next(o.load_failures["lw"] for o in outs if "lw" in o.load_failures)
    assert failure.stalled and "no push completion" in failure.reason


def _finished(outs: list, rids: set[str]) -> bool:
    return rids <= set().union(*(o.finished_recving | o.failed_recving for o in outs))


@pytest.mark.parametrize(("p_kbs", "d_kbs", "layers"), [(32, 128, 4), (128, 32, 4), (32, 128, 1), (64, 16, 2)])
def test_staged_pull_is_exact_and_frees_everything(p_kbs: int, d_kbs: int, layers: int) -> None:
    pair = Pair(p_kbs, d_kbs, layers)
    try:
        reqs = [pair.request("a", 300), pair.request("b", 9), pair.request("c", 257, computed=2 * d_kbs)]
        before = pair.d_mem.data.copy()
        pair.d.start_load_kv(StepMetadata(loads=[r["entry"] for r in reqs]))
        outs = poll_until([pair.d, pair.p], lambda o: _finished(o, {"a", "b", "c"})
                          and {"p-a", "p-b", "p-c"} <= set().union(*(x.finished_sending for x in o)))
        assert not any(o.failed_recving for o in outs), [o.load_failures for o in outs]
        for r in reqs:
            pair.check(r)
        dest = [np.concatenate([r["tail"] for r in reqs])]
        outside = ~sim.destination_mask(pair.d_mem, dest)
        assert np.array_equal(pair.d_mem.data[outside], before[outside]), "bytes outside D's blocks changed"
        figures = {rid: f for o in outs for rid, f in o.transfer_figures.items()}
        assert all("kv_relayout_s" in figures[r] for r in "abc")
        per_token = 3 * 2 * 64 * 4 * layers
        assert figures["c"]["kv_bytes"] < (257 - 2 * d_kbs + 2 * p_kbs) * per_token  # only the tail moved
        stats = pair.d.get_stats()["counters"]
        assert stats["staged_loads_total"] == 3 and stats["relayout_bytes_total"] >= (300 + 9 + 1) * per_token
        # whole pages: at most one descriptor per layer and P page
        assert figures["a"]["kv_descriptors"] <= layers * -(-301 // p_kbs)
        (pool,) = pair.d._staging.values()
        assert pool.free == pool.slots, "staging slots not given back"
        assert not pair.p.leases.leases and not pair.d.has_inflight()
    finally:
        pair.close()


def test_push_between_kernel_block_sizes_runs_as_a_staged_pull() -> None:
    pair = Pair(32, 128)
    try:
        req = pair.request("push", 200, mode="push")
        pair.d.start_load_kv(StepMetadata(loads=[req["entry"]]))
        outs = poll_until([pair.d, pair.p], lambda o: _finished(o, {"push"})
                          and "p-push" in set().union(*(x.finished_sending for x in o)))
        assert not any(o.failed_recving for o in outs)
        pair.check(req)
        counters = pair.d.get_stats()["counters"]
        assert counters["push_as_staged_pull_total"] == 1 and counters["staged_loads_total"] == 1
    finally:
        pair.close()


def test_loads_wait_for_staging_slots_then_run() -> None:
    """More loads than the staging area holds at once wait for slots, then all complete exactly."""
    model_page = 3 * 32 * 2 * 64 * 4 * 4  # one P page over the 4 layers
    pages = 14
    mib = -(-pages * model_page // 2**20)
    pair = Pair(32, 128, staging_mib=mib)
    try:
        (pool_slots,) = {pair.d.staging_for(32).slots}
        per_load = -(-201 // 32)
        count = pool_slots // per_load + 2  # more than fit at once
        reqs = [pair.request(f"w{i}", 200) for i in range(count)]
        pair.d.start_load_kv(StepMetadata(loads=[r["entry"] for r in reqs]))
        rids = {f"w{i}" for i in range(count)}
        outs = poll_until([pair.d, pair.p], lambda o: _finished(o, rids), timeout_s=20)
        assert not any(o.failed_recving for o in outs), [o.load_failures for o in outs]
        for r in reqs:
            pair.check(r)
        assert pair.d.staging_for(32).free == pool_slots
    finally:
        pair.close()


def test_a_load_larger_than_the_staging_area_fails_clearly() -> None:
    pair = Pair(32, 128, staging_mib=1)  # 1 MiB: 5 P pages of 32 tokens over 4 layers
    try:
        req = pair.request("big", 600)
        pair.d.start_load_kv(StepMetadata(loads=[req["entry"]]))
        outs = poll_until([pair.d], lambda o: _finished(o, {"big"}))
        failures = {rid: f for o in outs for rid, f in o.load_failures.items()}
        assert "raise staging_mib" in failures["big"].reason and "staging pages" in failures["big"].reason
        assert not failures["big"].bad_params
        assert pair.d.staging_for(32).free == pair.d.staging_for(32).slots
    finally:
        pair.close()


def test_hostile_token_count_is_bad_params_not_an_allocation() -> None:
    pair = Pair(32, 128)
    try:
        req = pair.request("evil", 100)
        req["entry"]["num_tokens"] = 2**60
        pair.d.start_load_kv(StepMetadata(loads=[req["entry"]]))
        outs = poll_until([pair.d], lambda o: _finished(o, {"evil"}))
        failures = {rid: f for o in outs for rid, f in o.load_failures.items()}
        assert failures["evil"].bad_params, failures["evil"]
    finally:
        pair.close()


def test_staging_slots_of_a_stalled_read_stay_out_of_use_until_the_quarantine_ends() -> None:
    from kvlink.connector.staging import StagingPool
    from kvlink.transfer.agent import NixlAgent

    mem = real_worker(_model(2), 1, 0, 128, 128, 8, seed=3, page_order=ORDER)
    page = 3 * 32 * 2 * 64 * 4 * 2  # one P page of 32 tokens over the 2 layers
    with NixlAgent("staging-pool") as agent:
        pool = StagingPool(mem.geometry, 32, 4 * page, agent)
        assert pool.slots == 4 and pool.free == 4
        held = pool.take(3, now=0.0)
        assert held is not None and len(set(held)) == 3
        assert pool.take(2, now=0.0) is None, "only one slot is free"
        pool.quarantine(held, until=10.0)
        assert pool.take(2, now=9.9) is None
        again = pool.take(4, now=10.0)
        assert again is not None and sorted(again) == [0, 1, 2, 3]
        pool.give(again)
        assert pool.free == 4
        assert pool.pages.shape == (2, 4, 3, 2 * 32 * 64) and pool.pages.flags.writeable
    with pytest.raises(ValueError, match="raise staging_mib"), NixlAgent("staging-small") as agent:
        StagingPool(mem.geometry, 32, page - 1, agent)


@pytest.mark.parametrize(("p_kbs", "d_kbs", "computed", "forwards"),
                         [(32, 128, 0, (90, 200)), (128, 32, 64, (130, 200)), (32, 128, 128, (200,))])
def test_layerwise_between_kernel_block_sizes_writes_whole_pages_into_staging(
        p_kbs: int, d_kbs: int, computed: int, forwards: tuple[int, ...]) -> None:
    """D asks first; P WRITEs each layer's whole P pages into D's staging pages as its
    forwards (a chunked prefill: `forwards` are the tokens computed after each) produce
    them, then the rest with `pushed`; D re-lays the staging pages out into its own. D's
    bytes equal P's, only D's blocks change, and the staging slots and P's lease are freed."""
    pair = Pair(p_kbs, d_kbs, layers=4)
    try:
        before = pair.d_mem.data.copy()
        req = pair.layerwise(200, computed=computed)
        poll_until([pair.d, pair.p], lambda o: bool(pair.p.push.streaming.get("p-lw")))
        (job,) = pair.p.push.streaming["p-lw"]
        table = [req["p_ids"].tolist()]
        sent = []
        for end in forwards:  # P's memory already holds every token: the forwards only report
            for layer in range(4):
                pair.p.push.save_kv_layer("p-lw", layer, end, table)
            assert job.layers is not None and not job.layers.failed
            sent.append(job.layers.bytes)
        pair.p.start_load_kv(StepMetadata(saves=[{"request_id": "p-lw", "block_ids": table}]))
        outs = poll_until([pair.d, pair.p], lambda o: _finished(o, {"lw"})
                          and "p-lw" in set().union(*(x.finished_sending for x in o)))
        assert not any(o.failed_recving for o in outs), [o.load_failures for o in outs]
        pair.check(req)
        outside = ~sim.destination_mask(pair.d_mem, [req["tail"]])
        assert np.array_equal(pair.d_mem.data[outside], before[outside]), "bytes outside D's blocks changed"
        figures = {rid: f for o in outs for rid, f in o.transfer_figures.items()}["lw"]
        assert "kv_relayout_s" in figures
        page = 3 * 2 * 64 * 4 * 4 * p_kbs  # one P page over the 4 layers
        first = computed // p_kbs * p_kbs
        assert figures["kv_bytes"] == -(-(200 - first) // p_kbs) * page  # whole P pages from the hit on
        assert sent[-1] == figures["kv_bytes"], "the last forward's layers carried the rest"
        assert all(0 < a < b for a, b in itertools.pairwise(sent)), sent  # chunk by chunk
        (pool,) = pair.d._staging.values()
        assert pool.free == pool.slots, "staging slots not given back"
        counters = pair.d.get_stats()["counters"]
        assert counters["staged_loads_total"] == 1
        assert not pair.p.leases.leases and not pair.d.has_inflight()
    finally:
        pair.close()


def test_layerwise_staging_for_another_prompt_gets_nothing_and_its_slots_wait_out_the_quarantine() -> None:
    """A D whose prompt is not the one P prefills: P writes nothing into its staging pages,
    D fails at its deadline, and those pages stay out of use for the quarantine time (P could
    still be writing) before they return."""
    pair = Pair(32, 128, quarantine_s=0.5, layerwise_wait_s=0.001)
    try:
        pair.layerwise(200, d_prompt_hash="not-p's")
        outs = poll_until([pair.d, pair.p], lambda o: _finished(o, {"lw"}), timeout_s=15)
        _assert_no_push_completion(outs)
        assert pair.p.get_stats()["counters"]["refused_push_requests_total"] == 1
        assert not pair.p.push.streaming.get("p-lw")
        (pool,) = pair.d._staging.values()
        assert pool.take(pool.slots, pair.d.clock()) is None, "slots reused inside the quarantine"
        time.sleep(0.6)
        assert pool.take(pool.slots, pair.d.clock()) is not None
    finally:
        pair.close()


@pytest.mark.parametrize(("p_kbs", "d_kbs", "named"), [(32, 128, None), (32, 32, 32), (32, 128, 64)])
def test_a_push_request_naming_another_id_space_than_p_plans_is_refused(
        p_kbs: int, d_kbs: int, named: int | None) -> None:
    """D's push request says which space its ids are in (`staging`: pages of P's kernel block
    size in D's staging area; absent: D's own blocks). One that does not match P's plan for
    that D (a D of another build, or a hostile one) is refused: P writes nothing, counts it,
    and D fails the load at its deadline with its memory untouched."""
    pair = Pair(p_kbs, d_kbs, layers=2, layerwise_wait_s=0.001)
    try:
        received = pair.p.push.on_push_request

        def tamper(msg, now):  # type: ignore[no-untyped-def]
            msg.info.pop("staging", None)
            if named is not None:
                msg.info["staging"] = named
            received(msg, now)

        pair.p.push.on_push_request = tamper  # type: ignore[method-assign]
        before = pair.d_mem.data.copy()
        pair.layerwise(100)
        outs = poll_until([pair.d, pair.p], lambda o: _finished(o, {"lw"}), timeout_s=15)
        _assert_no_push_completion(outs)
        assert pair.p.get_stats()["counters"]["refused_push_requests_total"] == 1
        assert not pair.p.push.streaming.get("p-lw"), "P streamed into a space it does not plan for"
        assert np.array_equal(pair.d_mem.data, before), "P wrote into D"
    finally:
        pair.close()


def test_p_dying_mid_stream_fails_d_at_its_deadline_and_leaves_nothing_held() -> None:
    """P streams the first layers of a layerwise request into D's staging pages, then dies (its
    worker shuts down: no more WRITEs, no `pushed`). D fails the load at its deadline, names
    the stall, holds no load, and keeps the staging slots out of use for the quarantine
    (a WRITE of P's could still have been in flight) before they return."""
    pair = Pair(32, 128, layers=4, layerwise_wait_s=0.001, handshake_timeout_s=1.0, quarantine_s=0.5)
    p_alive = True
    try:
        req = pair.layerwise(200)
        poll_until([pair.d, pair.p], lambda o: bool(pair.p.push.streaming.get("p-lw")))
        (job,) = pair.p.push.streaming["p-lw"]
        for layer in range(2):  # the first forward's first two layers, then P is gone
            pair.p.push.save_kv_layer("p-lw", layer, 96, [req["p_ids"].tolist()])
        assert job.layers is not None and job.layers.writes == 2
        pair.p.shutdown()
        p_alive = False
        started = time.monotonic()
        outs = poll_until([pair.d], lambda o: _finished(o, {"lw"}), timeout_s=30)
        _assert_no_push_completion(outs)
        assert time.monotonic() - started < 10, "D waited past its deadline"
        assert not pair.d.has_inflight()
        (pool,) = pair.d._staging.values()
        assert pool.take(pool.slots, pair.d.clock()) is None, "slots reused inside the quarantine"
        time.sleep(0.6)
        assert pool.take(pool.slots, pair.d.clock()) is not None
    finally:
        pair.d.shutdown()
        if p_alive:
            pair.p.shutdown()


def test_d_dying_mid_stream_stops_p_writing_and_p_frees_at_its_lease() -> None:
    """D dies while P streams a layerwise request into it: P's next layer WRITEs fail, P stops
    streaming that request (no `pushed`), counts the failure, and frees the request's blocks
    when its lease runs out; P keeps serving."""
    pair = Pair(32, 128, layers=4, p_config={"lease_s": 1.0})
    d_alive = True
    try:
        req = pair.layerwise(200)
        table = [req["p_ids"].tolist()]
        poll_until([pair.d, pair.p], lambda o: bool(pair.p.push.streaming.get("p-lw")))
        (job,) = pair.p.push.streaming["p-lw"]
        pair.p.push.save_kv_layer("p-lw", 0, 96, table)
        poll_until([pair.d, pair.p], lambda o: job.layers is not None and job.layers.inflight == 0)
        pair.d.shutdown()
        d_alive = False
        deadline = time.monotonic() + 20
        layer = 1
        while not (job.layers is not None and job.layers.failed):  # the next layers go to a dead D
            assert time.monotonic() < deadline, "P never saw its WRITEs to a dead D fail"
            pair.p.push.save_kv_layer("p-lw", layer % 4, 96 + 32 * (layer // 4), table)
            pair.p.get_finished()
            layer += 1
            time.sleep(0.05)
        pair.p.start_load_kv(StepMetadata(saves=[{"request_id": "p-lw", "block_ids": table}]))
        poll_until([pair.p], lambda o: "p-lw" in set().union(*(x.finished_sending for x in o)), timeout_s=15)
        assert not pair.p.push.streaming.get("p-lw")
        assert pair.p.get_stats()["counters"]["failed_transfers_total"] >= 1
        assert not pair.p.leases.leases
    finally:
        if d_alive:
            pair.d.shutdown()
        pair.p.shutdown()
