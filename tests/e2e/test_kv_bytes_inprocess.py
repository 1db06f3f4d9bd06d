"""A P and a D `LLMEngine` with the real NIXL connector in one process: after the load, D's pages
of the request hold exactly P's bytes (KV of tokens [0, N-1) through both block tables, and the
SSM state), and D's greedy answer equals a plain engine's.

P and D use different kernel block sizes, so the comparison goes through each side's own
logical -> kernel block mapping, not through equal tensor shapes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvlink.connector.config import ConnectorConfig
from kvlink.connector.scheduler import NixlScheduler
from kvlink.connector.secret import new_secret
from kvlink.connector.worker import NixlWorker
from kvlink.engine.engine import LLMEngine
from kvlink.engine.request import RequestOutput, RequestStatus, SamplingParams
from kvlink.layout.tensors import kv_tensor_specs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NUM_BLOCKS, BLOCK = 24, 16
P_KERNEL, D_KERNEL = 16, 8
DEADLINE_S = 30.0
SECRET = new_secret().encode()  # P and D of this test share it


@pytest.fixture(scope="module", params=["tiny-hybrid", "smollm2-135m"])
def model(request: pytest.FixtureRequest) -> Any:
    from kvlink.engine.models import load_model

    loaded, _ = load_model(request.param, progress=lambda line: None)
    return loaded


def connected_engine(name: str, model: Any, kernel: int) -> tuple[LLMEngine, NixlWorker]:
    config = ConnectorConfig(name, side_channel_port=0, stall_timeout_s=10.0, secret=SECRET)
    scheduler = NixlScheduler(config, tp_size=1, model=model.spec)
    worker = NixlWorker(config, model.spec, 1, 0, BLOCK, kernel, NUM_BLOCKS)
    engine = LLMEngine(model, NUM_BLOCKS, BLOCK, kernel, scheduler, worker)
    # The side channel got an ephemeral port at registration; P advertises that one.
    scheduler.config = dataclasses.replace(config, side_channel_port=worker.side_channel_port)
    return engine, worker


@pytest.fixture
def pair(model: Any) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    p, p_worker = connected_engine("P", model, P_KERNEL)
    d, d_worker = connected_engine("D", model, D_KERNEL)
    try:
        yield p, d
    finally:
        d_worker.shutdown()
        p_worker.shutdown()


def token_rows(engine: LLMEngine, tables: list[list[int]], num_tokens: int) -> dict[int, torch.Tensor]:
    """Per attention layer: the KV of tokens [0, num_tokens), as bytes, via the block table."""
    kernel = engine.kernel_block_size
    per_logical = engine.block_size // kernel
    specs = kv_tensor_specs(engine.model.spec, 1, engine.block_size, kernel, engine.num_blocks)
    rows: dict[int, torch.Tensor] = {}
    for spec, cache in zip(specs, engine.kv_caches, strict=True):
        if spec.kind != "attention":
            continue
        table = tables[spec.group]
        picked = []
        for token in range(num_tokens):
            logical = table[token // engine.block_size]
            offset = token % engine.block_size
            picked.append(cache[logical * per_logical + offset // kernel, :, offset % kernel, :])
        rows[spec.layer] = torch.stack(picked).contiguous().view(torch.uint8)
    return rows


def ssm_pages(engine: LLMEngine, tables: list[list[int]]) -> dict[int, torch.Tensor]:
    """Per SSM layer: the state page (the last block of the group's table), as bytes."""
    specs = kv_tensor_specs(engine.model.spec, 1, engine.block_size, engine.kernel_block_size,
                            engine.num_blocks)
    return {spec.layer: cache[tables[spec.group][-1]].contiguous().view(torch.uint8)
            for spec, cache in zip(specs, engine.kv_caches, strict=True) if spec.kind == "ssm"}


def run_until(engines: list[LLMEngine], done: Any, outputs: dict[str, list[RequestOutput]]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, "engines did not get there before the deadline"
        for engine in engines:
            for output in engine.step():
                outputs.setdefault(output.request_id, []).append(output)
                assert output.error is None, output.error
            if done():
                return


def plain_answer(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of a plain engine (no connector) for `prompt`: what D must answer."""
    plain = LLMEngine(model, NUM_BLOCKS, BLOCK, P_KERNEL)
    plain.add_request("c1", prompt, SamplingParams(max_tokens=max_tokens))
    reference: dict[str, list[RequestOutput]] = {}
    run_until([plain], lambda: not plain.has_unfinished(), reference)
    return [t for out in reference["c1"] for t in out.new_token_ids]


def assert_idle(engines: list[LLMEngine]) -> None:
    """Pools whole, every block free, no lease left."""
    for engine in engines:
        engine.check_integrity()
        assert engine.stats()["free_blocks"] == [NUM_BLOCKS] * len(engine.pools)
        assert engine.stats()["connector"]["leases"] == 0


def test_d_pages_equal_p_pages_bit_for_bit(pair: tuple[LLMEngine, LLMEngine], model: Any) -> None:
    p, d = pair
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(100, 40000, (75,), generator=generator).tolist()  # 4 full blocks + 10
    # Run an unrelated request on D first so that P's and D's block ids differ.
    d.add_request("warm", [t + 1 for t in prompt[:40]], SamplingParams(max_tokens=1))
    outputs: dict[str, list[RequestOutput]] = {}
    run_until([d], lambda: "warm" not in d.requests, outputs)

    p.add_request("p1", prompt, SamplingParams(max_tokens=1), {"do_remote_decode": True})
    run_until([p], lambda: "p1" in outputs, outputs)
    params = outputs["p1"][-1].kv_transfer_params
    assert params is not None and outputs["p1"][-1].finished
    p_tables = [list(ids) for ids in p.held["p1"]]
    n = len(prompt) - 1
    want_rows, want_ssm = token_rows(p, p_tables, n), ssm_pages(p, p_tables)
    assert all(rows.any() for rows in want_rows.values()), "P's prefill wrote nothing?"

    d.add_request("d1", prompt, SamplingParams(max_tokens=6), params)

    def loaded() -> bool:
        request = d.requests["d1"]
        return request.status is RequestStatus.WAITING and request.num_computed_tokens == n

    # Check right after the load, before D's forward overwrites the SSM state with token N's.
    run_until([d, p], loaded, outputs)
    d_tables = [list(ids) for ids in d.requests["d1"].block_tables]
    assert d_tables[0][:len(p_tables[0])] != p_tables[0]
    got_rows, got_ssm = token_rows(d, d_tables, n), ssm_pages(d, d_tables)
    assert got_rows.keys() == want_rows.keys() and got_ssm.keys() == want_ssm.keys()
    for layer, rows in want_rows.items():
        assert torch.equal(got_rows[layer], rows), f"layer {layer}: KV bytes differ"
    for layer, page in want_ssm.items():
        assert torch.equal(got_ssm[layer], page), f"layer {layer}: SSM state bytes differ"

    run_until([d, p], lambda: not d.has_unfinished() and not p.has_unfinished(), outputs)
    tokens = [t for out in outputs["d1"] for t in out.new_token_ids]
    assert outputs["d1"][0].kv_bytes and outputs["d1"][0].kv_bytes > 0

    assert tokens == plain_answer(model, prompt, 6)
    assert_idle([p, d])


@pytest.mark.parametrize("tail", [20, 1], ids=["partial-hit", "full-hit"])
def test_d_prefix_hit_gets_p_state(pair: tuple[LLMEngine, LLMEngine], model: Any, tail: int) -> None:
    """D caches a prompt's first 2 blocks; a request sharing them moves only the rest of its
    KV (nothing with tail=1: every shipped token is cached) and, for a hybrid model, P's SSM
    state after N-1 tokens into a fresh block. D's answer equals a plain engine's."""
    p, d = pair
    generator = torch.Generator().manual_seed(4)
    shared = torch.randint(100, 40000, (2 * BLOCK,), generator=generator).tolist()
    prompt = shared + torch.randint(100, 40000, (tail,), generator=generator).tolist()
    outputs: dict[str, list[RequestOutput]] = {}
    d.add_request("warm", [*shared, 7, 8, 9], SamplingParams(max_tokens=1))  # cached on D
    run_until([d], lambda: "warm" not in d.requests, outputs)
    p.add_request("p1", prompt, SamplingParams(max_tokens=1), {"do_remote_decode": True})
    run_until([p], lambda: "p1" in outputs, outputs)
    p_tables = [list(ids) for ids in p.held["p1"]]
    want_ssm = ssm_pages(p, p_tables)
    n = len(prompt) - 1

    d.add_request("d1", prompt, SamplingParams(max_tokens=6), outputs["p1"][-1].kv_transfer_params)
    stateful = bool(want_ssm)

    def loaded() -> bool:
        request = d.requests["d1"]
        return request.status is RequestStatus.WAITING and request.num_computed_tokens == n

    if stateful:  # look at the state before D's forward overwrites it with token N's
        run_until([d, p], loaded, outputs)
        request = d.requests["d1"]
        assert request.num_local_prefix_tokens == 2 * BLOCK
        got_ssm = ssm_pages(d, [list(ids) for ids in request.block_tables])
        for layer, page in want_ssm.items():
            assert torch.equal(got_ssm[layer], page), f"layer {layer}: SSM state bytes differ"
    run_until([d, p], lambda: not d.has_unfinished() and not p.has_unfinished(), outputs)
    moved = outputs["d1"][0].kv_bytes
    kv_per_token = model.spec.dtype_bytes * sum(s.shape[1] * s.shape[3] for s in kv_tensor_specs(
        model.spec, 1, BLOCK, D_KERNEL, NUM_BLOCKS) if s.kind == "attention")
    state_bytes = sum(page.numel() for page in want_ssm.values())
    chunk = math.gcd(P_KERNEL, D_KERNEL)  # attention moves whole token chunks
    tail_tokens = -(-(n - 2 * BLOCK) // chunk) * chunk
    if stateful or tail > 1:
        assert moved == tail_tokens * kv_per_token + state_bytes, "only the tail and the state move"
    else:
        assert moved is None, "nothing to move"

    assert [t for out in outputs["d1"] for t in out.new_token_ids] == plain_answer(model, prompt, 6)
    assert_idle([p, d])
