"""Corrupted KV injected and caught inside vLLM, real servers (SmolLM2-135M fp32, block 128).

P's worker flips one byte of each request's first shipped unit right after sealing it
(`KVLINK_TEST_FAULT=flip_after_seal`, the env of P's processes only). Three D, one per case,
since a D's `verify_kv` is fixed when it starts:

  P  core 0   the fault injected; verify_kv sample (it seals what it ships either way)
  F  core 1   verify_kv full, policy fail: the request ends with an HTTP error (kvlink's proxy)
  R  core 1   verify_kv full, policy recompute: D prefills itself and answers colocated vLLM's text
  O  core 1   verify_kv off: D runs on the flipped byte; HTTP 200, whether its text differs is printed

The colocated references are F's own greedy answers to prompts sent without
kv_transfer_params (F decodes none of them, and no prompt shares a first block with another),
which spares a fifth server start. After every case vLLM's KV usage is back to 0 on P and on
that D and kvlink holds nothing there; P frees on D's `done`, well before its lease ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from vllm_client import complete, greedy_token_ids, metric, token_ids, wait_idle, wait_metric

from kvlink.bench.routers import router_argv
from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import VllmServerSpec, served_model
from kvlink.procs.launcher import Service, free_port, start_process, stop_all, wait_healthy

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

pytestmark = pytest.mark.slow

LEASE_S = 30.0
MAX_TOKENS = 16
SENTENCE = "A lantern swung above pier number {} while the gulls circled the fishing boats."
# ~10, ~170 and ~350 tokens: inside one block, past one, past two.
PROMPTS = ["The last keeper of the lighthouse was",
           " ".join(SENTENCE.format(i) for i in range(10)),
           " ".join(SENTENCE.format(i) for i in range(20, 40))]
MISMATCHES = "vllm:kvlink_kv_checksum_mismatch_total"
VERIFIED = "vllm:kvlink_kv_verified_units_total"


@dataclass
class Deployment:
    p: Service
    fail: Service
    recompute: Service
    off: Service
    metrics_ports: dict[str, int]
    model: str
    references: dict[str, list[int]]

    def prefill(self, prompt: str) -> dict[str, Any]:
        resp = complete(self.p.url, self.model, prompt, max_tokens=1, stream=False,
                        kv_transfer_params={"do_remote_decode": True})
        assert resp.status_code == 200, resp.text
        params: dict[str, Any] = resp.json()["kv_transfer_params"]
        return params

    def decode(self, d: Service, prompt: str, params: dict[str, Any]) -> httpx.Response:
        return complete(d.url, self.model, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)

    def idle(self, *servers: Service) -> None:
        """P and these D hold nothing: KV usage 0, no lease, load or transfer (P: before its lease ends)."""
        for server in (self.p, *servers):
            took = wait_idle(server.url, self.metrics_ports[server.name], LEASE_S - 10, server.name)
            assert took < LEASE_S - 10, server.name


def tagged(tag: str) -> list[str]:
    return [f"({tag}) {p}" for p in PROMPTS]


@pytest.fixture(scope="module")
def deployment(vllm_servers: VllmServers, smollm2_dir: Path) -> Iterator[Deployment]:
    secret = new_secret()
    ports = {f"integrity-{name}": free_port() for name in ("p", "fail", "recompute", "off")}

    def spec(name: str, cores: str, policy: str = "fail", env: dict[str, str] | None = None,
             **extra: Any) -> VllmServerSpec:
        return vllm_servers.kvlink_spec(smollm2_dir, f"integrity-{name}", cores, secret, env=env, policy=policy,
                                        extra={"lease_s": LEASE_S, "metrics_port": ports[f"integrity-{name}"],
                                               **extra}, block_size=128)

    p, fail, recompute, off = vllm_servers.start(
        spec("p", "0", env={"KVLINK_TEST_FAULT": "flip_after_seal"}),
        spec("fail", "1", verify_kv="full"), spec("recompute", "1", policy="recompute", verify_kv="full"),
        spec("off", "1", verify_kv="off"))
    try:
        model = served_model(p.url)
        references = greedy_token_ids(fail.url, model, [*tagged("recompute"), *tagged("off")])
        yield Deployment(p, fail, recompute, off, ports, model, references)
    finally:
        vllm_servers.stop(p, fail, recompute, off)


@pytest.fixture(scope="module")
def proxy(deployment: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """kvlink's proxy in front of P and the D with policy fail."""
    port = free_port()
    router = start_process("proxy-integrity", router_argv("kvlink", [deployment.p.url], [deployment.fail.url],
                                                          port, 60.0),
                           f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("proxy-integrity"))
    try:
        wait_healthy([router], 60)
        yield router
    finally:
        stop_all([router])


def test_p_says_it_corrupts_on_purpose(deployment: Deployment) -> None:
    log = deployment.p.log_path.read_text(errors="replace")
    assert "TEST FAULTS INJECTED (KVLINK_TEST_FAULT=flip_after_seal)" in log


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_policy_fail_answers_an_http_error_through_the_proxy(deployment: Deployment, proxy: Service,
                                                             index: int) -> None:
    d = deployment.fail
    prompt = tagged("fail")[index]
    before = metric(d.url, MISMATCHES)
    failures = d.log_path.read_text(errors="replace").count("failed: KV checksum mismatch in 1 unit(s) from ")
    resp = httpx.post(proxy.url + "/v1/completions", timeout=60, json={
        "model": deployment.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert resp.status_code == 502, resp.text
    assert "decode instance" in resp.json()["error"]["message"] and "HTTP 500" in resp.json()["error"]["message"]
    assert wait_metric(d.url, MISMATCHES, before) == before + 1
    log = d.log_path.read_text(errors="replace")
    # The cause is in D's log, naming P's engine, rank and block (vLLM answers only "Internal server error").
    assert log.count("failed: KV checksum mismatch in 1 unit(s) from ") == failures + 1, log[-3000:]
    assert "P sealed" in log
    deployment.idle(d)


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_policy_recompute_answers_colocated_text(deployment: Deployment, index: int) -> None:
    d = deployment.recompute
    prompt = tagged("recompute")[index]
    before = metric(d.url, MISMATCHES)
    resp = deployment.decode(d, prompt, deployment.prefill(prompt))
    assert token_ids(resp) == deployment.references[prompt]
    assert wait_metric(d.url, MISMATCHES, before) == before + 1  # caught, then computed on D
    deployment.idle(d)


def test_verify_off_runs_on_the_flipped_byte(deployment: Deployment) -> None:
    d = deployment.off
    outcomes = []
    for prompt in tagged("off"):
        loads = d.log_path.read_text(errors="replace").count("kvlink load ")
        resp = deployment.decode(d, prompt, deployment.prefill(prompt))
        same = token_ids(resp) == deployment.references[prompt]  # HTTP 200: nothing noticed the byte
        assert d.log_path.read_text(errors="replace").count("kvlink load ") == loads + 1  # loaded, not recomputed
        outcomes.append(f"{len(prompt)} chars: {'same text' if same else 'text differs'}")
    print("[verify_kv off, one byte flipped on P] " + "; ".join(outcomes))
    assert metric(d.url, VERIFIED) == 0 and metric(d.url, MISMATCHES) == 0
    deployment.idle(d)
