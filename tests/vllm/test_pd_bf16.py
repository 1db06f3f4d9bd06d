"""SmolLM2 in bfloat16 inside vLLM: P block 32 ↔ D block 128 equals colocated vLLM at bf16.

Without AMX (this machine has AVX-512 BF16 but no AMX tiles) vLLM's CPU attention stores bf16
blocks in the `vec` order, K transposed, like fp32: D reads whole P blocks into its staging
pages and re-lays the 2-byte elements out. The answers are compared token for token with
the same vLLM serving bf16 colocated.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from vllm_client import complete, greedy_token_ids, token_ids

from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import VllmServerSpec, kvlink_transfer_config, served_model
from kvlink.procs.launcher import Service

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

pytestmark = pytest.mark.slow

PROMPTS = ["The last keeper of the lighthouse was",
           " ".join(f"Note {i}: the ferry left the harbour before dawn." for i in range(16))]
DIRECTIONS = ("32->128", "128->32")


@pytest.fixture(scope="module")
def references(vllm_servers: VllmServers, smollm2_dir: Path) -> dict[str, list[int]]:
    spec = VllmServerSpec(model=smollm2_dir, port=vllm_servers.http_port(), dtype="bfloat16", cores="0",
                          enforce_eager=True, name="smollm2-bf16-colocated")
    (server,) = vllm_servers.start(spec)
    try:
        return greedy_token_ids(server.url, served_model(server.url),
                                [f"({d}) {p}" for d in DIRECTIONS for p in PROMPTS])
    finally:
        vllm_servers.stop(server)


@pytest.fixture(scope="module")
def bf16_pair(vllm_servers: VllmServers, smollm2_dir: Path,
              references: dict[str, list[int]]) -> Iterator[tuple[Service, Service]]:
    secret = new_secret()

    def spec(name: str, block: int, core: str) -> VllmServerSpec:
        return VllmServerSpec(model=smollm2_dir, port=vllm_servers.http_port(), dtype="bfloat16", block_size=block,
                              cores=core, enforce_eager=True, env={"KVLINK_SECRET": secret},
                              kv_transfer_config=kvlink_transfer_config(vllm_servers.side_channel_port()),
                              name=f"smollm2-bf16-{name}")

    p32, d128 = vllm_servers.start(spec("block32", 32, "0"), spec("block128", 128, "1"))
    yield p32, d128
    vllm_servers.stop(p32, d128)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_bf16_between_block_sizes_equals_colocated(bf16_pair: tuple[Service, Service],
                                                   references: dict[str, list[int]], direction: str,
                                                   index: int) -> None:
    block32, block128 = bf16_pair
    p, d = (block32, block128) if direction == "32->128" else (block128, block32)
    prompt = f"({direction}) {PROMPTS[index]}"
    model = served_model(p.url)
    prefill = httpx.post(p.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    prefill.raise_for_status()
    resp = complete(d.url, model, prompt, kv_transfer_params=prefill.json()["kv_transfer_params"])
    assert token_ids(resp) == references[prompt]
