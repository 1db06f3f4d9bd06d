"""Layerwise inside vLLM while P prefills a prompt chunk by chunk (vLLM's chunked prefill).

P runs with `--max-num-batched-tokens 64`, so a prompt of a few hundred tokens takes several
forwards; after each, vLLM's `save_kv_layer` hands kvlink each layer, and P WRITEs the blocks
that forward completed. D must answer exactly what the classic pull from the same P answers
(prefix caching off on both, so both paths compute the same: P's chunked prefill, D's decode),
D reads nothing of a layerwise request, and P WRITEs every layer more than once per request.
Two servers (SmolLM2-135M fp32, block 32): P on core 0, D on core 1, and `kvlink proxy --mode
layerwise` in front.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from vllm_client import metric

from kvlink.bench.routers import router_argv
from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import served_model
from kvlink.procs.launcher import Service, free_port, start_process, stop_all, wait_healthy

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

pytestmark = pytest.mark.slow

CHUNK = 64
LAYERS = 30  # SmolLM2-135M
MAX_TOKENS = 16
COUNT = "vllm:kvlink_bytes_transferred_count"
SENTENCE = "A heron number {} waits at the edge of the marsh for the morning fish."
PROMPTS = [" ".join(SENTENCE.format(i) for i in range(start, start + n)) for start, n in ((0, 12), (50, 20))]


@pytest.fixture(scope="module")
def pair(vllm_servers: VllmServers, smollm2_dir: Path) -> Iterator[tuple[Service, Service]]:
    secret, no_cache = new_secret(), ["--no-enable-prefix-caching"]
    yield from vllm_servers.serve(
        vllm_servers.kvlink_spec(smollm2_dir, "kvlink-chunked-p", "0", secret, block_size=32,
                                 args=[*no_cache, "--max-num-batched-tokens", str(CHUNK)]),
        vllm_servers.kvlink_spec(smollm2_dir, "kvlink-chunked-d", "1", secret, block_size=32, args=no_cache))


def pull(p: Service, d: Service, prompt: str) -> str:
    model = served_model(p.url)
    first = httpx.post(p.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    first.raise_for_status()
    answer = httpx.post(d.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": first.json()["kv_transfer_params"]})
    answer.raise_for_status()
    return str(answer.json()["choices"][0]["text"])


def settle(url: str, name: str, within_s: float = 5.0) -> float:
    """`name` once it has not moved for half a second (stats reach vLLM's API server late)."""
    value, deadline = metric(url, name), time.monotonic() + within_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = metric(url, name)
        if now == value:
            return now
        value = now
    return value


def test_layerwise_over_a_chunked_prefill_equals_the_classic_pull(pair: tuple[Service, Service],
                                                                  tmp_path: Path) -> None:
    p, d = pair
    model = served_model(p.url)
    port = free_port()
    router = start_process("router-chunked", router_argv("kvlink", [p.url], [d.url], port, 60.0,
                                                        extra_args=["--mode", "layerwise"]),
                           f"http://127.0.0.1:{port}", tmp_path)
    try:
        wait_healthy([router], 60)

        def ask(prompt: str) -> str:
            resp = httpx.post(router.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text + router.log_tail()
            return str(resp.json()["choices"][0]["text"])

        ask("(first: the proxy learns P's side channel from a classic answer) " + PROMPTS[0])
        for prompt in PROMPTS:
            tokens = len(httpx.post(p.url + "/tokenize", json={"model": model, "prompt": prompt}, timeout=10)
                         .json()["tokens"])
            assert tokens > 3 * CHUNK, "the prompt must take several forwards on P"
            wrote, read = settle(p.url, COUNT), settle(d.url, COUNT)
            streamed = ask(prompt)
            writes = settle(p.url, COUNT) - wrote
            assert settle(d.url, COUNT) == read, "D read a layerwise request"
            # P's forwards each complete CHUNK / 32 blocks: each layer goes out after each forward
            # D's request has arrived for, plus the rest with `pushed`.
            assert writes > LAYERS, f"P wrote each layer once at most: {writes} WRITEs for {tokens} tokens"
            assert streamed == pull(p, d, prompt)
        assert "layerwise push of" in p.log_path.read_text(errors="replace")
    finally:
        stop_all([router])
