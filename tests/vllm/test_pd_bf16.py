"""SmolLM2 in bfloat16 inside vLLM: P block 32 ↔ D block 128 equals colocated vLLM at bf16.

vLLM's CPU attention stores bf16 blocks in the `amx` order on a CPU with AMX tiles
(`torch.cpu._is_amx_tile_supported()`; machines of this kind differ) and in the `vec` order
(K transposed, like fp32) without: either way D reads whole P blocks into its staging pages
and re-lays the 2-byte elements out; the connector logs which kernel each server ran. The answers are compared token for token with
the same vLLM serving bf16 colocated. Both servers name the connector only (no module path):
vLLM finds it through installed kvlink's `vllm.general_plugins` entry point.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from vllm_client import complete, token_ids

from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import VllmServerSpec, served_model
from kvlink.procs.launcher import Service

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

pytestmark = pytest.mark.slow

PROMPTS = ["The last keeper of the lighthouse was",
           " ".join(f"Note {i}: the ferry left the harbour before dawn." for i in range(16))]
DIRECTIONS = ("32->128", "128->32")


@pytest.fixture(scope="module")
def pair_specs(vllm_servers: VllmServers, smollm2_dir: Path) -> list[VllmServerSpec]:
    secret = new_secret()
    return [vllm_servers.kvlink_spec(smollm2_dir, f"smollm2-bf16-block{block}", core, secret, by_name=True,
                                     dtype="bfloat16", block_size=block)
            for block, core in ((32, "0"), (128, "1"))]


@pytest.fixture(scope="module")
def references(vllm_servers: VllmServers, smollm2_dir: Path,
               pair_specs: list[VllmServerSpec]) -> dict[str, list[int]]:
    spec = VllmServerSpec(model=smollm2_dir, port=vllm_servers.http_port(), dtype="bfloat16", cores="0",
                          enforce_eager=True, name="smollm2-bf16-colocated")
    return vllm_servers.colocated_token_ids(spec, [f"({d}) {p}" for d in DIRECTIONS for p in PROMPTS],
                                            alongside=pair_specs)


@pytest.fixture(scope="module")
def bf16_pair(vllm_servers: VllmServers, pair_specs: list[VllmServerSpec],
              references: dict[str, list[int]]) -> Iterator[list[Service]]:
    yield from vllm_servers.serve(*pair_specs)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_bf16_between_block_sizes_equals_colocated(bf16_pair: list[Service],
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


def test_both_servers_found_the_connector_by_name(bf16_pair: list[Service]) -> None:
    """Neither config names a module: vLLM's engine core and worker made KvlinkConnector from the
    name alone, which only kvlink's `vllm.general_plugins` entry point registers."""
    for server in bf16_pair:
        log = server.log_path.read_text(errors="replace")
        assert "kv_connector='KvlinkConnector'" in log and "kv_connector_module_path=None" in log, server.name
        assert "kvlink connector (scheduler)" in log and "kvlink in vLLM: rank 0/1 registered" in log, server.name
