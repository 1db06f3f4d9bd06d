"""Connector workers over real NIXL inside one process: P holds, D pulls, bytes match, P frees."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import sim
from kvmem import real_worker, region_sizes

from kvlink.connector import verifier as verifier_module
from kvlink.connector.api import StepMetadata, WorkerOutput
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.worker import NixlWorker
from kvlink.layout.presets import TINY_HYBRID

pytestmark = pytest.mark.timeout(60)


def poll_until(workers: list[NixlWorker], cond, timeout_s: float = 10.0) -> list[WorkerOutput]:
    outs: list[WorkerOutput] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in workers:
            outs.append(w.get_finished())
        if cond(outs):
            return outs
        time.sleep(0.001)
    raise AssertionError("condition not reached before the deadline")


@contextlib.contextmanager
def worker_pair(d_verify_kv: str, p_verify_kv: str = "sample") -> Iterator[tuple[sim.WorkerMemory, NixlWorker, NixlWorker]]:
    """A P and a D worker of the tiny hybrid (block 16, 32 blocks) registered over real NIXL;
    yields (P's memory, P, D) and shuts both down."""
    model = TINY_HYBRID
    p_mem = real_worker(model, 1, 0, 16, 16, 32, seed=1)
    d_mem = real_worker(model, 1, 0, 16, 16, 32, seed=2)
    p = NixlWorker(ConnectorConfig("P", side_channel_port=0, verify_kv=p_verify_kv), model, 1, 0, 16, 16, 32)
    d = NixlWorker(ConnectorConfig("D", side_channel_port=0, verify_kv=d_verify_kv), model, 1, 0, 16, 16, 32)
    try:
        p.register_kv_caches(*region_sizes(p_mem))
        d.register_kv_caches(*region_sizes(d_mem))
        yield p_mem, p, d
    finally:
        d.shutdown()
        p.shutdown()


def test_pull_hybrid_tp1_bytes_match_and_p_frees() -> None:
    model = TINY_HYBRID
    p_mem = real_worker(model, 1, 0, 16, 16, 32, seed=1)
    d_mem = real_worker(model, 1, 0, 16, 8, 32, seed=2)
    p = NixlWorker(ConnectorConfig("P", side_channel_port=0), model, 1, 0, 16, 16, 32)
    d = NixlWorker(ConnectorConfig("D", side_channel_port=0), model, 1, 0, 16, 8, 32)
    try:
        p.register_kv_caches(*region_sizes(p_mem))
        d.register_kv_caches(*region_sizes(d_mem))
        n = 40
        rng = np.random.default_rng(3)
        logical = sim.make_logical(model, n, rng)
        p_ids = [np.array([5, 9, 2], dtype=np.int64), np.array([7], dtype=np.int64)]
        d_ids = [np.array([11, 3, 30], dtype=np.int64), np.array([4], dtype=np.int64)]
        tokens = [np.arange(n - 1), np.arange(0)]
        sim.store(p_mem, logical, p_ids, tokens)
        p.start_load_kv(StepMetadata(saves=[{"request_id": "p1", "block_ids": [x.tolist() for x in p_ids]}]))
        load = {
            "request_id": "d1", "remote_request_id": "p1", "remote_engine_id": "P",
            "remote_host": "127.0.0.1", "remote_port": p.side_channel_port, "remote_tp_size": 1,
            "remote_block_ids": [x.tolist() for x in p_ids], "transfer_mode": "pull",
            "local_block_ids": [x.tolist() for x in d_ids], "local_computed_tokens": 0,
            "num_tokens": n - 1,
        }
        before = d_mem.data.copy()
        d.start_load_kv(StepMetadata(loads=[load]))
        outs = poll_until([d, p], lambda o: any("d1" in x.finished_recving for x in o)
                          and any("p1" in x.finished_sending for x in o))
        assert not any(x.failed_recving for x in outs)
        got = sim.load(d_mem, d_ids, tokens, 0)
        want = sim.expected_for(d_mem, logical, tokens)
        for layer, rows in want.rows.items():
            assert np.array_equal(got.rows[layer], rows)
        for key, state in want.ssm.items():
            assert np.array_equal(got.ssm[key], state)
        outside = ~sim.destination_mask(d_mem, d_ids)
        assert np.array_equal(d_mem.data[outside], before[outside])
        stats = d.get_stats()
        assert stats["counters"]["transfers_total"] == 1
        assert stats["counters"]["bytes_total"] > 0
        assert not p.leases.leases
    finally:
        d.shutdown()
        p.shutdown()


def test_handshake_failure_says_whether_the_params_or_the_peer_are_at_fault() -> None:
    """Nobody listening (P dead) is the peer's failure, worth retrying through another P; a
    listener serving another engine means the params name what is not there."""
    model = TINY_HYBRID
    p_mem = real_worker(model, 1, 0, 16, 16, 32, seed=1)
    d_mem = real_worker(model, 1, 0, 16, 16, 32, seed=2)
    p = NixlWorker(ConnectorConfig("P", side_channel_port=0), model, 1, 0, 16, 16, 32)
    d = NixlWorker(ConnectorConfig("D", side_channel_port=0), model, 1, 0, 16, 16, 32)
    try:
        p.register_kv_caches(*region_sizes(p_mem))
        d.register_kv_caches(*region_sizes(d_mem))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            closed_port = sock.getsockname()[1]

        def load(rid: str, engine_id: str, port: int) -> dict[str, object]:
            return {"request_id": rid, "remote_request_id": "p1", "remote_engine_id": engine_id,
                    "remote_host": "127.0.0.1", "remote_port": port, "remote_tp_size": 1,
                    "remote_block_ids": [[1, 2], [3]], "transfer_mode": "pull",
                    "local_block_ids": [[4, 5], [6]], "local_computed_tokens": 0, "num_tokens": 20}

        d.start_load_kv(StepMetadata(loads=[load("dead", "P-gone", closed_port),
                                            load("wrong", "not-P", p.side_channel_port)]))
        outs = poll_until([d], lambda o: {"dead", "wrong"} <= set().union(*(x.failed_recving for x in o)))
        failures = {rid: f for x in outs for rid, f in x.load_failures.items()}
        assert not failures["dead"].bad_params and not failures["dead"].stalled, failures["dead"]
        assert "Connection refused" in failures["dead"].reason
        assert failures["wrong"].bad_params, failures["wrong"]
    finally:
        d.shutdown()
        p.shutdown()


def test_a_request_sealed_right_after_its_forward_is_not_hashed_again_at_its_save() -> None:
    """vLLM's P seals a request in the step that completes its prefill (`seal_now`); the save
    that follows one step later, over the same blocks and tokens, only starts the lease. D
    (verify_kv full) checks every unit against those digests at its first READ."""
    model = TINY_HYBRID
    n = 40
    with worker_pair("full") as (p_mem, p, d):
        rng = np.random.default_rng(4)
        logical = sim.make_logical(model, n, rng)
        p_ids = [np.array([5, 9, 2], dtype=np.int64), np.array([7], dtype=np.int64)]
        sim.store(p_mem, logical, p_ids, [np.arange(n - 1), np.arange(0)])
        prompt = list(range(100, 100 + n))
        entry = {"request_id": "p1", "block_ids": [x.tolist() for x in p_ids], "token_ids": prompt[:-1],
                 "num_tokens": n - 1}
        p.seal_now([entry])
        sealed = p.stats.counters["kv_sealed_bytes_total"]
        assert sealed > 0 and p.stats.counters["kv_early_seals_total"] == 1
        p.start_load_kv(StepMetadata(saves=[dict(entry)]))
        assert p.stats.counters["kv_sealed_bytes_total"] == sealed, "the save hashed the request again"
        load = {
            "request_id": "d1", "remote_request_id": "p1", "remote_engine_id": "P",
            "remote_host": "127.0.0.1", "remote_port": p.side_channel_port, "remote_tp_size": 1,
            "remote_block_ids": entry["block_ids"], "transfer_mode": "pull",
            "local_block_ids": [[1, 3, 30], [4]], "local_computed_tokens": 0,
            "num_tokens": n - 1, "token_ids": prompt[:-1],
        }
        d.start_load_kv(StepMetadata(loads=[load]))
        outs = poll_until([d, p], lambda o: any("d1" in x.finished_recving for x in o))
        assert not any(x.failed_recving for x in outs)
        assert d.stats.counters["kv_verified_units_total"] > 0
        assert d.stats.counters["kv_digest_rereads_total"] == 0
        # A save over other blocks than the early seal (vLLM preempted and re-placed it) is hashed.
        p.seal_now([{**entry, "request_id": "p2"}])
        p.start_load_kv(StepMetadata(saves=[{**entry, "request_id": "p2", "block_ids": [[6, 9, 2], [7]]}]))
        assert p.stats.counters["kv_sealed_bytes_total"] > 2 * sealed


def test_a_load_that_cannot_start_fails_alone_and_the_worker_goes_on() -> None:
    """An error while starting one load (here: the reader's start raising, as a planner bug
    would) fails that request with the reason; the next load of the same step still runs."""
    with worker_pair("off") as (_, p, d):
        p_ids = [[5, 9, 2], [7]]
        p.start_load_kv(StepMetadata(saves=[{"request_id": "p1", "block_ids": p_ids}]))
        assert d.pull is not None
        real_start = d.pull.start

        def start(engine, entry):  # type: ignore[no-untyped-def]
            if entry["request_id"] == "bad":
                raise IndexError("descriptor ids must lie in [0, 10), got [12]")
            return real_start(engine, entry)

        d.pull.start = start  # type: ignore[method-assign]
        base = {"remote_request_id": "p1", "remote_engine_id": "P", "remote_host": "127.0.0.1",
                "remote_port": p.side_channel_port, "remote_tp_size": 1, "remote_block_ids": p_ids,
                "transfer_mode": "pull", "local_computed_tokens": 0, "num_tokens": 39}
        d.start_load_kv(StepMetadata(loads=[{**base, "request_id": "bad", "local_block_ids": [[1, 3, 30], [4]]},
                                            {**base, "request_id": "good", "local_block_ids": [[6, 8, 10], [11]]}]))
        outs = poll_until([d, p], lambda o: any("good" in x.finished_recving for x in o))
        failed = {rid: f for x in outs for rid, f in x.load_failures.items()}
        assert set(failed) == {"bad"} and "IndexError" in failed["bad"].reason


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_verify_kv", ["off", "sample"])
def test_a_checking_d_counts_and_names_loads_from_a_p_that_keeps_no_digests(
        p_verify_kv: str, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    """D checks (sample) but P runs with verification off: the loads finish unchecked, and
    D says so, counting each (`kv_unchecked_loads_total`) and warning once for that P. With
    P sealing (the control) the same loads are checked and nothing is counted. D reads the
    KV (pull) or P writes it (push)."""
    model = TINY_HYBRID
    n = 40
    with worker_pair("sample", p_verify_kv) as (p_mem, p, d):
        logical = sim.make_logical(model, n, np.random.default_rng(5))
        prompt = list(range(200, 200 + n))
        for i, (p_ids, d_ids) in enumerate([([[5, 9, 2], [7]], [[1, 3, 30], [4]]),
                                            ([[10, 11, 12], [13]], [[14, 15, 16], [17]])]):
            sim.store(p_mem, logical, [np.array(x, dtype=np.int64) for x in p_ids], [np.arange(n - 1), np.arange(0)])
            entry = {"request_id": f"p{i}", "block_ids": p_ids, "token_ids": prompt[:-1], "num_tokens": n - 1}
            p.start_load_kv(StepMetadata(saves=[entry]))
            d.start_load_kv(StepMetadata(loads=[{
                "request_id": f"d{i}", "remote_request_id": f"p{i}", "remote_engine_id": "P",
                "remote_host": "127.0.0.1", "remote_port": p.side_channel_port, "remote_tp_size": 1,
                "remote_block_ids": p_ids, "transfer_mode": mode, "local_block_ids": d_ids,
                "local_computed_tokens": 0, "num_tokens": n - 1, "token_ids": prompt[:-1]}]))
            outs = poll_until([d, p], lambda o, i=i: any(f"d{i}" in x.finished_recving for x in o))
            assert not any(x.failed_recving for x in outs)
        counters = d.stats.counters
        warnings = [r for r in caplog.records if "go unchecked" in r.getMessage()]
        if p_verify_kv == "off":
            assert counters.get("kv_unchecked_loads_total") == 2
            assert not counters.get("kv_verified_units_total")
            assert len(warnings) == 1 and "loads from P go unchecked" in warnings[0].getMessage()
        else:
            assert not counters.get("kv_unchecked_loads_total")
            assert counters["kv_verified_units_total"] > 0 and not warnings


def test_one_d_checks_loads_from_ps_whose_digest_tables_differ_in_rows() -> None:
    """A D reading from two P engines of one model whose KV pools hold different numbers of
    blocks (32 and 48): their digest tables have rows of one shape, so D lands both in one
    slot pool, but each P's slices are addressed in that P's own table (seen inside vLLM: P of
    64-token blocks after one of 128, D's READ paired slices of different groups)."""
    model = TINY_HYBRID
    n = 40
    rng = np.random.default_rng(5)
    logical = sim.make_logical(model, n, rng)
    prompt = list(range(200, 200 + n))
    d_mem = real_worker(model, 1, 0, 16, 16, 32, seed=2)
    d = NixlWorker(ConnectorConfig("D", side_channel_port=0, verify_kv="full"), model, 1, 0, 16, 16, 32)
    ps: list[NixlWorker] = []
    try:
        d.register_kv_caches(*region_sizes(d_mem))
        for k, blocks in enumerate((32, 48)):
            p_mem = real_worker(model, 1, 0, 16, 16, blocks, seed=10 + k)
            p = NixlWorker(ConnectorConfig(f"P{k}", side_channel_port=0), model, 1, 0, 16, 16, blocks)
            ps.append(p)
            p.register_kv_caches(*region_sizes(p_mem))
            p_ids = [np.array([5, blocks - 9, 2], dtype=np.int64), np.array([7], dtype=np.int64)]
            sim.store(p_mem, logical, p_ids, [np.arange(n - 1), np.arange(0)])
            entry = {"request_id": f"p{k}", "block_ids": [x.tolist() for x in p_ids], "token_ids": prompt[:-1],
                     "num_tokens": n - 1}
            p.seal_now([entry])
            p.start_load_kv(StepMetadata(saves=[dict(entry)]))
            checked = d.stats.counters.get("kv_verified_units_total", 0)
            d.start_load_kv(StepMetadata(loads=[{
                "request_id": f"d{k}", "remote_request_id": f"p{k}", "remote_engine_id": f"P{k}",
                "remote_host": "127.0.0.1", "remote_port": p.side_channel_port, "remote_tp_size": 1,
                "remote_block_ids": entry["block_ids"], "transfer_mode": "pull",
                "local_block_ids": [[1, 3, 30], [4 + k]], "local_computed_tokens": 0,
                "num_tokens": n - 1, "token_ids": prompt[:-1]}]))
            outs = poll_until([d, p], lambda o, k=k: any(f"d{k}" in x.finished_recving for x in o))
            assert not any(x.failed_recving for x in outs), [x.failed_recving for x in outs]
            assert d.stats.counters["kv_verified_units_total"] > checked
            got = sim.load(d_mem, [np.array([1, 3, 30]), np.array([4 + k])], [np.arange(n - 1), np.arange(0)], 0)
            want = sim.expected_for(d_mem, logical, [np.arange(n - 1), np.arange(0)])
            for layer, rows in want.rows.items():
                assert np.array_equal(got.rows[layer], rows)
    finally:
        d.shutdown()
        for p in ps:
            p.shutdown()


@pytest.mark.parametrize("cores", [2, 1])
def test_a_check_that_cannot_be_planned_fails_its_load_and_every_digest_slot_comes_back(
        cores: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is planned on the verifier's helper thread while the KV READ runs (on the
    worker's own thread where it is bound to one core). If the planner raises (a bug, or
    params it cannot use), the load fails with that reason after its READ, and never runs
    unchecked. The slot rows it reserved go back, and the next load
    is checked as usual (and P frees its blocks)."""
    model = TINY_HYBRID
    n = 40
    with worker_pair("sample") as (p_mem, p, d):
        logical = sim.make_logical(model, n, np.random.default_rng(5))
        prompt = list(range(200, 200 + n))
        assert d.pull is not None and d.digest_slots is not None
        real_plan = d.pull.verifier.plan

        def plan(engine, entry, specs):  # type: ignore[no-untyped-def]
            if entry["request_id"] == "d0":
                raise ValueError("cannot locate a unit")
            return real_plan(engine, entry, specs)

        d.pull.verifier.plan = plan  # type: ignore[method-assign]
        monkeypatch.setattr(verifier_module.os, "sched_getaffinity", lambda _: set(range(cores)))
        helper_threads = {t.name for t in threading.enumerate() if t.name.startswith("kvlink-verify")}
        for i, (p_ids, d_ids) in enumerate([([[5, 9, 2], [7]], [[1, 3, 30], [4]]),
                                            ([[10, 11, 12], [13]], [[14, 15, 16], [17]])]):
            sim.store(p_mem, logical, [np.array(x, dtype=np.int64) for x in p_ids], [np.arange(n - 1), np.arange(0)])
            entry = {"request_id": f"p{i}", "block_ids": p_ids, "token_ids": prompt[:-1], "num_tokens": n - 1}
            p.seal_now([entry])
            p.start_load_kv(StepMetadata(saves=[dict(entry)]))
            d.start_load_kv(StepMetadata(loads=[{
                "request_id": f"d{i}", "remote_request_id": f"p{i}", "remote_engine_id": "P",
                "remote_host": "127.0.0.1", "remote_port": p.side_channel_port, "remote_tp_size": 1,
                "remote_block_ids": p_ids, "transfer_mode": "pull", "local_block_ids": d_ids,
                "local_computed_tokens": 0, "num_tokens": n - 1, "token_ids": prompt[:-1]}]))
            outs = poll_until([d, p], lambda o, i=i: any(f"d{i}" in x.finished_recving | x.failed_recving
                                                         for x in o))
            failed = {rid: f for x in outs for rid, f in x.load_failures.items()}
            if i == 0:
                assert set(failed) == {"d0"} and "could not plan the KV check" in failed["d0"].reason
                assert "cannot locate a unit" in failed["d0"].reason
                assert not any("d0" in x.finished_recving for x in outs)
                assert {1, 3, 30, 4} <= set().union(*(x.invalid_block_ids for x in outs))
            else:
                assert not failed
            # D holds no slot rows either way (a READ aborted in flight leaves P's blocks to
            # its lease; a checked load that passed tells P to free)
            pools = list(d.digest_slots._pools.values())
            assert pools and all(pool.free == pool.slots for pool in pools)
            assert not d.book.loads
        poll_until([d, p], lambda o: "p1" not in p.leases.leases)
        assert d.stats.counters["kv_verified_units_total"] > 0
        started = {t.name for t in threading.enumerate() if t.name.startswith("kvlink-verify")} - helper_threads
        assert bool(started) == (cores > 1)


def test_a_side_channel_port_in_use_is_named_as_kvlinks_setting() -> None:
    """A port already taken fails registration naming side_channel_port (inside vLLM, the
    bare "Address already in use" read as vLLM's own --port)."""
    model = TINY_HYBRID
    mem = real_worker(model, 1, 0, 16, 16, 32, seed=3)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        worker = NixlWorker(ConnectorConfig("P", side_channel_port=port, verify_kv="off"), model, 1, 0, 16, 16, 32)
        try:
            with pytest.raises(OSError, match=rf"side_channel_port {port} \+ TP rank 0 = port {port}\) cannot listen"):
                worker.register_kv_caches(*region_sizes(mem))
        finally:
            worker.shutdown()
