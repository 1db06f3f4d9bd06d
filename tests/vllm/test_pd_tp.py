"""Heterogeneous TP inside vLLM: P at TP 2 → D at TP 1, and TP 1 → TP 2, equal to colocated.

SmolLM2's 9 heads cannot shard over 2 ranks, so this uses a seeded-random Llama with 4
attention and 2 KV heads (`tiny_llama_tp_dir`). The TP 2 server binds one core per rank
(`VLLM_CPU_OMP_THREADS_BIND="0|1"`); both servers are `kv_both`, so each is P for the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from vllm_client import metric, wait_metric

from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import VllmServerSpec, kvlink_transfer_config, served_model
from kvlink.integrations.vllm.models import tiny_llama_tp_dir
from kvlink.procs.launcher import Service

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

# Three workers on two cores: one core carries a P worker and a D worker. This runs because
# the connector keeps NIXL's progress thread off and shortens vLLM's queue busy-polling
# (docs/vllm.md, CPU use); with either one spinning, D starved until P's lease ran out.
pytestmark = pytest.mark.slow

MAX_TOKENS = 16
PROMPTS = ["The last keeper of the lighthouse was",
           " ".join(f"Sentence {i} is about a small red boat on the lake." for i in range(14))]


def complete(url: str, model: str, prompt: str, **extra: object) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        **extra})


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return tiny_llama_tp_dir()


@pytest.fixture(scope="module")
def pair_specs(vllm_servers: VllmServers, tiny_dir: Path) -> list[VllmServerSpec]:
    secret = new_secret()

    def spec(name: str, tp: int, cores: str) -> VllmServerSpec:
        return VllmServerSpec(model=tiny_dir, port=vllm_servers.http_port(), cores=cores, tensor_parallel_size=tp,
                              kv_transfer_config=kvlink_transfer_config(vllm_servers.side_channel_port() + 10 * tp),
                              enforce_eager=True, env={"KVLINK_SECRET": secret}, name=f"tiny-llama-{name}")

    return [spec("tp2", 2, "0|1"), spec("tp1", 1, "1")]


@pytest.fixture(scope="module")
def references(vllm_servers: VllmServers, tiny_dir: Path, pair_specs: list[VllmServerSpec]) -> dict[str, str]:
    spec = VllmServerSpec(model=tiny_dir, port=vllm_servers.http_port(), cores="0", enforce_eager=True,
                          name="tiny-llama-colocated")
    (server,) = vllm_servers.start(spec, alongside=pair_specs)
    try:
        model = served_model(server.url)
        answers = {}
        for tag in ("2->1", "1->2"):
            for prompt in PROMPTS:
                resp = complete(server.url, model, f"({tag}) {prompt}")
                resp.raise_for_status()
                answers[f"({tag}) {prompt}"] = str(resp.json()["choices"][0]["text"])
        return answers
    finally:
        vllm_servers.stop(server)


@pytest.fixture(scope="module")
def tp_pair(vllm_servers: VllmServers, pair_specs: list[VllmServerSpec],
            references: dict[str, str]) -> Iterator[tuple[Service, Service]]:
    tp2, tp1 = vllm_servers.start(*pair_specs)
    yield tp2, tp1
    vllm_servers.stop(tp2, tp1)


@pytest.mark.parametrize("direction", ["2->1", "1->2"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_heterogeneous_tp_equals_colocated(tp_pair: tuple[Service, Service], references: dict[str, str],
                                           direction: str, index: int) -> None:
    tp2, tp1 = tp_pair
    p, d = (tp2, tp1) if direction == "2->1" else (tp1, tp2)
    model = served_model(p.url)
    prompt = f"({direction}) {PROMPTS[index]}"
    first = complete(p.url, model, prompt, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["tp_size"] == (2 if direction == "2->1" else 1)
    checked = metric(d.url, "vllm:kvlink_kv_verified_units_total")
    answer = complete(d.url, model, prompt, kv_transfer_params=params)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == references[prompt]
    assert wait_metric(d.url, "vllm:kvlink_kv_verified_units_total", checked) > checked  # D checked P's digests
    log = d.log_path.read_text(errors="replace")
    assert "kvlink load " in log  # D loaded the KV (it did not recompute it)
