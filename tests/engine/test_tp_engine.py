"""Tensor parallelism across real processes (gloo on loopback) gives the TP-1 tokens."""

from __future__ import annotations

import pytest

from kvlink.engine.engine import LLMEngine
from kvlink.engine.models import load_model
from kvlink.engine.request import SamplingParams
from kvlink.engine.tp import TPModel, all_reduce, init_group, stop_followers
from kvlink.engine.tp_worker import launch_followers
from kvlink.procs.launcher import free_port

pytestmark = pytest.mark.timeout(120)


def generate(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_tiny_hybrid_tp2_matches_tp1() -> None:
    prompt = [5, 17, 300, 41, 7, 99, 1200, 3] * 5
    single, _ = load_model("tiny-hybrid", progress=lambda s: None)
    want = generate(LLMEngine(single, 32, 16, 16), prompt, 12)

    port = free_port()
    spec = {"model": "tiny-hybrid", "tp": 2, "port": port, "block_size": 16,
            "kernel_block_size": 16, "num_blocks": 32}
    procs = launch_followers(spec, None)
    try:
        init_group(0, 2, port)
        shard, _ = load_model("tiny-hybrid", 0, 2, all_reduce, progress=lambda s: None)
        got = generate(LLMEngine(TPModel(shard), 32, 16, 16), prompt, 12)
        stop_followers()
        assert got == want
        for p in procs:
            assert p.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
