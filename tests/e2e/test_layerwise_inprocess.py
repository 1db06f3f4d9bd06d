"""Layerwise mode with the real NIXL connector, a P and a D `LLMEngine` in one process: D gets
the request first and asks P; P writes each layer into D's blocks as soon as its forward has
computed it, then the prompt's tail chunk (and the SSM state) with `pushed`. D's pages then
hold exactly P's bytes, as after a classic pull, and D's greedy answer equals a plain
engine's. A D that asks after P's prefill gets it all in one WRITE (a push). A D whose prompt
is not the one P prefills gets nothing written, and fails at its deadline; nothing leaks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_kv_bytes_inprocess import (
    BLOCK,
    D_KERNEL,
    NUM_BLOCKS,
    P_KERNEL,
    SECRET,
    assert_idle,
    plain_answer,
    run_until,
    ssm_pages,
    token_rows,
)

from kvlink.connector.config import ConnectorConfig
from kvlink.connector.scheduler import NixlScheduler
from kvlink.connector.worker import NixlWorker
from kvlink.engine.engine import LLMEngine
from kvlink.engine.request import RequestOutput, RequestStatus, SamplingParams
from kvlink.layout.spec import is_ssm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {}


@pytest.fixture
def model(models: dict[str, Any], model_name: str) -> Any:
    from kvlink.engine.models import load_model

    if model_name not in models:
        models[model_name], _ = load_model(model_name, progress=lambda line: None)
    return models[model_name]


def engine_for(name: str, model: Any, kernel: int, policy: str = "fail") -> tuple[LLMEngine, NixlWorker]:
    # Short deadlines: a D that never gets `pushed` gives up after 3 + 1 + 2 s and keeps its
    # blocks out of use for 1 s; a P that nobody reads from frees after 4 s.
    config = ConnectorConfig(name, side_channel_port=0, stall_timeout_s=3.0, handshake_timeout_s=1.0,
                             secret=SECRET, layerwise_wait_s=2.0, lease_s=4.0, quarantine_s=1.0,
                             load_failure_policy=policy)  # type: ignore[arg-type]
    scheduler = NixlScheduler(config, tp_size=1, model=model.spec)
    worker = NixlWorker(config, model.spec, 1, 0, BLOCK, kernel, NUM_BLOCKS)
    engine = LLMEngine(model, NUM_BLOCKS, BLOCK, kernel, scheduler, worker)
    scheduler.config = dataclasses.replace(config, side_channel_port=worker.side_channel_port)
    return engine, worker


@contextlib.contextmanager
def connected_pair(model: Any) -> Iterator[tuple[LLMEngine, LLMEngine, NixlWorker]]:
    """P and D engines of `model`, each with its real NIXL worker (shut down on exit)."""
    p, p_worker = engine_for("P", model, P_KERNEL)
    d, d_worker = engine_for("D", model, D_KERNEL)
    try:
        yield p, d, p_worker
    finally:
        d_worker.shutdown()
        p_worker.shutdown()


@pytest.fixture
def pair(model: Any) -> Iterator[tuple[LLMEngine, LLMEngine, NixlWorker]]:
    with connected_pair(model) as engines:
        yield engines


def layerwise_params(p: LLMEngine, p_request_id: str) -> dict[str, Any]:
    """What kvlink's proxy gives D in layerwise mode: P's side channel and P's request id."""
    scheduler = p.connector
    assert isinstance(scheduler, NixlScheduler)
    return {"do_remote_prefill": True, "transfer_mode": "layerwise", "remote_engine_id": "P",
            "remote_host": "127.0.0.1", "remote_port": scheduler.config.side_channel_port,
            "tp_size": 1, "remote_request_id": p_request_id, "remote_block_ids": []}


P_PARAMS = {"do_remote_decode": True, "transfer_mode": "layerwise"}


def p_writes(worker: NixlWorker) -> list[Any]:
    return list(worker.stats.transfers)


# Every case on the hybrid (attention and SSM layers); SmolLM2 (30 layers) where D joins mid-forward.
@pytest.mark.parametrize(("model_name", "when"), [
    ("tiny-hybrid", "d-asks-first"), ("tiny-hybrid", "d-asks-mid-forward"), ("tiny-hybrid", "p-finished-first"),
    ("tiny-hybrid", "d-asks-first, chunked prefill"), ("smollm2-135m", "d-asks-mid-forward"),
    ("smollm2-135m", "d-asks-first, P prefix hit")])
def test_layerwise_d_pages_equal_p_pages(pair: tuple[LLMEngine, LLMEngine, NixlWorker], model: Any,
                                         model_name: str, when: str) -> None:
    p, d, p_worker = pair
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(100, 40000, (90,), generator=generator).tolist()  # 5 blocks + 10 tokens
    outputs: dict[str, list[RequestOutput]] = {}
    d.add_request("warm", [t + 1 for t in prompt[:40]], SamplingParams(max_tokens=1))  # D's ids differ
    run_until([d], lambda: "warm" not in d.requests, outputs)
    # A first layerwise request connects P to D (once per D rank, as in a server that runs).
    d.add_request("d0", prompt[:30], SamplingParams(max_tokens=2), layerwise_params(p, "p0"))
    p.add_request("p0", prompt[:30], SamplingParams(max_tokens=1), P_PARAMS)
    run_until([d, p], lambda: not d.has_unfinished() and not p.has_unfinished(), outputs)
    writes_before = len(p_writes(p_worker))
    n = len(prompt) - 1

    def loaded() -> bool:
        request = d.requests.get("d1")
        return request is not None and request.status is RequestStatus.WAITING and request.num_computed_tokens == n

    d_first = when != "p-finished-first"
    chunked = when.endswith("chunked prefill")
    hits: list[int] = []
    if when.endswith("P prefix hit"):  # P holds the prompt's first 4 blocks: its forward computes the rest only
        p.add_request("p-warm", prompt[:70], SamplingParams(max_tokens=1))
        run_until([p], lambda: not p.has_unfinished(), outputs)
        sink = p.runner.layer_sink
        assert sink is not None

        def note_hit(rid: str, layer: int, computed: int, tables: Any) -> None:
            if rid == "p1" and layer == 0:
                hits.append(p.requests["p1"].num_local_prefix_tokens)
            sink(rid, layer, computed, tables)

        p.runner.layer_sink = note_hit
    if chunked:  # P prefills 32 tokens per step: each chunk's layers leave as they are computed
        p.scheduler.prefill_chunk = 32
    if when.startswith("d-asks-first"):
        d.add_request("d1", prompt, SamplingParams(max_tokens=6), layerwise_params(p, "p1"))
        for _ in range(3):  # D allocates and sends its push request; P has no such request yet
            d.step()
        p.add_request("p1", prompt, SamplingParams(max_tokens=1), P_PARAMS)
    elif when == "d-asks-mid-forward":
        # As when P and D get the request at once: D's push request arrives while P's forward
        # is past its first layer. P looks between layers and catches up on the earlier ones.
        sink = p.runner.layer_sink
        assert sink is not None

        def d_asks_during_layer_1(rid: str, layer: int, computed: int, tables: Any) -> None:
            if rid == "p1" and layer == 1 and "d1" not in d.requests:
                d.add_request("d1", prompt, SamplingParams(max_tokens=6), layerwise_params(p, "p1"))
                for _ in range(3):
                    d.step()
            sink(rid, layer, computed, tables)

        p.runner.layer_sink = d_asks_during_layer_1
        p.add_request("p1", prompt, SamplingParams(max_tokens=1), P_PARAMS)
        p.step()
        p.runner.layer_sink = sink
        # Every layer was posted during that forward, layer 0 too (caught up at layer 1).
        (job,) = p_worker.push.streaming["p1"]
        assert job.layers is not None and job.layers.writes == model.spec.num_layers
    else:
        p.add_request("p1", prompt, SamplingParams(max_tokens=1), P_PARAMS)
        p.step()  # the whole prefill, before D asks: it all goes in the last WRITE
        d.add_request("d1", prompt, SamplingParams(max_tokens=6), layerwise_params(p, "p1"))
    run_until([d, p], loaded, outputs)
    if hits:  # P's cached blocks went with its first forward's layers, with what it computed
        p.runner.layer_sink = sink
        assert hits == [64], hits
    p_tables = [list(ids) for ids in p.held["p1"]]
    d_tables = [list(ids) for ids in d.requests["d1"].block_tables]
    assert d_tables[0][:len(p_tables[0])] != p_tables[0]
    want_rows, want_ssm = token_rows(p, p_tables, n), ssm_pages(p, p_tables)
    got_rows, got_ssm = token_rows(d, d_tables, n), ssm_pages(d, d_tables)
    assert all(rows.any() for rows in want_rows.values())
    for layer, rows in want_rows.items():
        assert torch.equal(got_rows[layer], rows), f"layer {layer}: KV bytes differ"
    for layer, page in want_ssm.items():
        assert torch.equal(got_ssm[layer], page), f"layer {layer}: SSM state bytes differ"
    # D first: one WRITE per layer (its KV, or its SSM state once final) right after that layer
    # of P's forward, all of the prompt: `pushed` then goes alone. D after: one WRITE of it all.
    writes = p_writes(p_worker)[writes_before:]
    if chunked:  # 32, 64 then 89 tokens: every attention layer three times, the SSM state once
        attention = sum(1 for g in model.spec.layer_groups if not is_ssm(model.spec.groups[g]))
        ssm = model.spec.num_layers - attention
        assert len(writes) == 3 * attention + ssm, [w.nbytes for w in writes]
    else:
        assert len(writes) == (model.spec.num_layers if d_first else 1), [w.nbytes for w in writes]

    run_until([d, p], lambda: not d.has_unfinished() and not p.has_unfinished(), outputs)
    tokens = [t for out in outputs["d1"] for t in out.new_token_ids]
    moved = outputs["d1"][0].kv_bytes
    assert moved == sum(w.nbytes for w in writes), "D's figure is what P wrote"
    assert tokens == plain_answer(model, prompt, 6)
    assert_idle([p, d])


@pytest.fixture
def hybrid_pair() -> Iterator[tuple[LLMEngine, LLMEngine, NixlWorker]]:
    from kvlink.engine.models import load_model

    model, _ = load_model("tiny-hybrid", progress=lambda line: None)
    with connected_pair(model) as engines:
        yield engines


def test_layerwise_for_another_prompt_writes_nothing(hybrid_pair: tuple[LLMEngine, LLMEngine, NixlWorker]) -> None:
    """D names P's request but brings another prompt: P refuses to write (the prompt hashes
    differ), D fails the load at its deadline with policy `fail`, and every block comes back."""
    p, d, p_worker = hybrid_pair
    prompt = list(range(200, 260))
    outputs: dict[str, list[RequestOutput]] = {}
    writes_before = len(p_writes(p_worker))
    d.add_request("d1", [t + 1 for t in prompt], SamplingParams(max_tokens=4), layerwise_params(p, "p1"))
    p.add_request("p1", prompt, SamplingParams(max_tokens=1), P_PARAMS)

    def failed() -> bool:
        return any(o.finished for o in outputs.get("d1", []))

    deadline = time.monotonic() + 30
    while not failed():  # run_until refuses outputs with errors: this one must end in one
        assert time.monotonic() < deadline, "D never gave up on the load"
        for engine in (d, p):
            for output in engine.step():
                outputs.setdefault(output.request_id, []).append(output)
    assert len(p_writes(p_worker)) == writes_before, "P wrote for a prompt it did not prefill"
    assert p_worker.stats.counters.get("refused_push_requests_total", 0) >= 1
    (failure,) = [o for o in outputs["d1"] if o.finished]
    assert failure.error_kind == "kv_load_stalled", failure
    run_until([d, p], lambda: not d.has_unfinished() and not p.has_unfinished(), outputs)
    assert_idle([p, d])


def _warm_up(p: LLMEngine, d: LLMEngine, prompt: list[int], outputs: dict[str, list[RequestOutput]]) -> None:
    """One layerwise request connects P to D (once per D rank, as in a server that runs)."""
    d.add_request("d0", prompt[:30], SamplingParams(max_tokens=2), layerwise_params(p, "p0"))
    p.add_request("p0", prompt[:30], SamplingParams(max_tokens=1), P_PARAMS)
    run_until([d, p], lambda: not d.has_unfinished() and not p.has_unfinished(), outputs)


def _counter(engine: LLMEngine, name: str) -> int:
    assert isinstance(engine.worker, NixlWorker)
    return int(engine.worker.stats.counters.get(name, 0))


@pytest.mark.parametrize("when", ["before P has the request", "mid-forward"])
def test_client_leaving_a_layerwise_request_gives_the_blocks_back_once_p_stopped(
        hybrid_pair: tuple[LLMEngine, LLMEngine, NixlWorker], when: str) -> None:
    """The client leaves after D asked P for the layers (the proxy aborts the request on D):
    D keeps its blocks while P may still write into them, asks P to stop, and gives them
    back as soon as P answers, long before D's deadline; P writes no more for it (the rest
    of its forward included), frees its own blocks without waiting for its lease, and the
    next request on the same pair is exact."""
    p, d, p_worker = hybrid_pair
    generator = torch.Generator().manual_seed(11)
    prompt = torch.randint(100, 40000, (90,), generator=generator).tolist()
    outputs: dict[str, list[RequestOutput]] = {}
    _warm_up(p, d, prompt, outputs)
    writes_before, layers = len(p_writes(p_worker)), p.model.spec.num_layers
    d.add_request("d1", prompt, SamplingParams(max_tokens=4), layerwise_params(p, "p1"))
    for _ in range(3):  # D allocates and sends its push request
        d.step()
    assert d.requests["d1"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    left = time.monotonic()
    if when == "before P has the request":
        assert d.abort("d1")
        d.step()  # D's worker asks P to stop
        assert "d1" in d.held, "D gave its blocks back before P said it writes no more"
        p.step()  # P takes the cancel (with D's push request) and answers
    else:
        sink = p.runner.layer_sink
        assert sink is not None

        def client_leaves_during_layer_1(rid: str, layer: int, computed: int, tables: Any) -> None:
            sink(rid, layer, computed, tables)
            if rid == "p1" and layer == 1 and "d1" in d.requests:
                assert d.abort("d1")
                d.step()
                assert "d1" in d.held, "D gave its blocks back while P's forward still writes them"

        p.runner.layer_sink = client_leaves_during_layer_1
        try:
            p.add_request("p1", prompt, SamplingParams(max_tokens=1), P_PARAMS)
            p.step()  # the whole prefill: P takes D's cancel only once its forward is over
        finally:
            p.runner.layer_sink = sink
    run_until([d, p], lambda: "d1" not in d.held, outputs)
    took = time.monotonic() - left
    assert took < 2.0, f"D held the blocks {took:.1f} s (its deadline is 6 s)"
    writes = p_writes(p_worker)[writes_before:]
    if when == "before P has the request":
        assert not writes, "P wrote for a request D had cancelled"
    else:  # at most the forward's layers, never the `pushed` WRITE that ends a push
        assert 1 <= len(writes) <= layers, [w.nbytes for w in writes]
    assert _counter(d, "cancelled_loads_total") == 1 and _counter(p, "cancelled_pushes_total") == 1
    if "p1" not in p.requests and "p1" not in p.held:
        p.add_request("p1", prompt, SamplingParams(max_tokens=1), P_PARAMS)  # the prefill D no longer wants
    run_until([d, p], lambda: not d.has_unfinished() and not p.has_unfinished(), outputs)
    assert time.monotonic() - left < 4.0, "P held its blocks until its lease ran out"
    assert_idle([p, d])
    # The same pair serves the next request exactly.
    d.add_request("d2", prompt, SamplingParams(max_tokens=4), layerwise_params(p, "p2"))
    p.add_request("p2", prompt, SamplingParams(max_tokens=1), P_PARAMS)
    run_until([d, p], lambda: not d.has_unfinished() and not p.has_unfinished(), outputs)
    assert [t for out in outputs["d2"] for t in out.new_token_ids] == plain_answer(p.model, prompt, 4)
    assert_idle([p, d])
