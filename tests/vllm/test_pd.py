"""kvlink inside vLLM, real processes: vLLM P → vLLM D equals vLLM colocated, token for token.

Four kvlink servers share the module (all `kv_both`, SmolLM2-135M fp32):
  A: block 128, core 0, policy fail        B: block 128, core 1, policy fail
  C: block 32,  core 0, policy recompute   E: block 32,  core 1, policy fail
A→B is the same block size, C→B is 32 → 128 and A→E is 128 → 32 (the two cases vLLM's
NixlConnector corrupts or refuses): every P → D pair crosses cores, because a P holding a
lease keeps its engine stepping and vLLM's worker busy-polls meanwhile, which starved a D
worker pinned to the same core (docs/vllm.md, CPU use). Pull and push modes, D prefix hits
(bytes from the connector's own stats on D's /metrics), kvlink's proxy and vllm-router in
front. The fault tests come last: they freeze and kill servers.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest
from layerwise_client import with_p_held
from vllm_client import metric, wait_metric
from vllm_client import wait_idle as idle_after

from kvlink.bench.routers import router_argv, vllm_router_executable
from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import VllmServerSpec, kvlink_transfer_config, served_model
from kvlink.procs.launcher import Service, free_port, start_process, stop_all, wait_healthy

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
LEASE_S = 15.0
STALL_S = 10.0
HANDSHAKE_S = 10.0
QUARANTINE_S = 5.0  # a stalled load's failure reaches vLLM this much later (its blocks held)
SENTENCE = "The quick brown fox number {} jumps over the lazy dog near the river bank."
# 9, ~150, ~300 and ~600 tokens: inside one block, past one block of 128, past several. No
# prompt starts with another's first block, so D's prefix cache never hits across tests.
PROMPTS = [
    "The last keeper of the lighthouse was",
    " ".join(SENTENCE.format(i) for i in range(9)),
    " ".join(SENTENCE.format(i) for i in range(100, 118)),
    "Once upon a time, " + " ".join(SENTENCE.format(i) for i in range(200, 236)),
]
PAGE_BYTES_PER_TOKEN = 30 * 3 * 2 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads, K and V of 64, fp32
LAYERWISE_STAGED = [0, 1, 3]  # the first goes the classic way (the proxy learns P's side channel)
# D checks what it loads against P's digests (verify_kv's default, sample): units found equal.
VERIFIED = "vllm:kvlink_kv_verified_units_total"


class PD:
    """The module's servers and how to drive them."""

    def __init__(self, a: Service, b: Service, c: Service, e: Service, ports: dict[str, int],
                 model: str) -> None:
        self.a, self.b, self.c, self.e = a, b, c, e
        self.metrics_ports = ports
        self.model = model

    def prefill(self, p: Service, prompt: str, mode: str | None = None) -> dict[str, Any]:
        kv: dict[str, Any] = {"do_remote_decode": True}
        if mode is not None:
            kv["transfer_mode"] = mode
        resp = httpx.post(p.url + "/v1/completions", timeout=60, json={
            "model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False,
            "kv_transfer_params": kv})
        resp.raise_for_status()
        params: dict[str, Any] = resp.json()["kv_transfer_params"]
        return params

    def decode(self, d: Service, prompt: str, params: dict[str, Any], timeout_s: float = 60) -> httpx.Response:
        return httpx.post(d.url + "/v1/completions", timeout=timeout_s, json={
            "model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "kv_transfer_params": params})

    def run(self, p: Service, d: Service, prompt: str, mode: str | None = None,
            d_reads: bool | None = None) -> tuple[str, float]:
        """Text D answers after P prefilled, and the KV bytes D's connector reported loading
        (`d_reads`: D posts the transfer; default: unless in push mode)."""
        before = vllm_metric(d, "vllm:kvlink_bytes_transferred_sum")
        count = vllm_metric(d, "vllm:kvlink_bytes_transferred_count")
        resp = self.decode(d, prompt, self.prefill(p, prompt, mode))
        assert resp.status_code == 200, resp.text
        # Stats reach the API server with the next engine step. In push mode P's stats count the
        # bytes (it posts the WRITEs); D's count nothing.
        d_reads = mode != "push" if d_reads is None else d_reads
        deadline = time.monotonic() + (5 if d_reads else 0)
        while vllm_metric(d, "vllm:kvlink_bytes_transferred_count") == count and time.monotonic() < deadline:
            time.sleep(0.1)
        return str(resp.json()["choices"][0]["text"]), vllm_metric(d, "vllm:kvlink_bytes_transferred_sum") - before



def vllm_metric(server: Service, name: str, labels: str = "") -> float:
    return metric(server.url, name, labels)


def wait_idle(pd: PD, server: Service, name: str, within_s: float) -> float:
    """Seconds until vLLM's KV usage on `server` is 0 and kvlink holds nothing there."""
    return idle_after(server.url, pd.metrics_ports[name], within_s, name)


def worker_counter(pd: PD, name: str, counter: str) -> float:
    """A kvlink counter from the worker's own /metrics (rank 0)."""
    return metric(f"http://127.0.0.1:{pd.metrics_ports[name]}", f"kvlink_{counter}")


def workers_of(server: Service) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children(recursive=True) if "Worker" in p.name()]


def reference_prompts() -> list[str]:
    """Every prompt whose answer a test compares with colocated vLLM (tags first: no shared prefixes)."""
    prompts = [f"({tag}) {p}" for tag in ("128->128", "push 128->128") for p in PROMPTS]
    prompts += [f"({tag}) {p}" for tag in ("32->128", "128->32") for p in PROMPTS]
    prompts += [f"(push {tag}) {PROMPTS[i]}" for tag in ("32->128", "128->32") for i in (1, 3)]
    prompts += [f"(via {kind}) {PROMPTS[i]}" for kind in ("kvlink", "vllm-router") for i in (0, 2)]
    prompts += ["(prefix) " + PROMPTS[3], "(frozen, recompute) " + PROMPTS[2], "(killed, recompute) " + PROMPTS[1]]
    prompts += ["(frozen) " + PROMPTS[2], "(frozen push, recompute) " + PROMPTS[1]]
    prompts += ["(client leaves, layerwise) " + PROMPTS[2]]
    prompts += [f"(layerwise) {p}" for p in PROMPTS]
    prompts += [f"(layerwise {tag}) {PROMPTS[i]}" for tag in ("32->128", "128->32") for i in LAYERWISE_STAGED]
    return prompts


class Colocated:
    """Greedy answers of vLLM colocated (same vLLM, no connector, block 128), all asked up front
    so that the colocated server can stop before the P/D servers start (memory)."""

    def __init__(self, server: Service) -> None:
        model = served_model(server.url)
        self.answers: dict[str, str] = {}
        for prompt in reference_prompts():
            resp = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
            resp.raise_for_status()
            self.answers[prompt] = str(resp.json()["choices"][0]["text"])

    def __call__(self, prompt: str) -> str:
        return self.answers[prompt]


@pytest.fixture(scope="module")
def colocated(vllm_servers: VllmServers, smollm2_server: Service) -> Colocated:
    answers = Colocated(smollm2_server)
    vllm_servers.stop(smollm2_server)
    return answers


@pytest.fixture(scope="module")
def pd_specs(vllm_servers: VllmServers, smollm2_dir: Path) -> tuple[list[VllmServerSpec], dict[str, int]]:
    """The module's P/D servers a, b, c, e (one secret) and their metrics ports."""
    secret = new_secret()
    ports = {name: vllm_servers.side_channel_port() + 40 for name in "abce"}

    def spec(name: str, block: int, cores: str, policy: str) -> VllmServerSpec:
        config = kvlink_transfer_config(vllm_servers.side_channel_port(), lease_s=LEASE_S,
                                        stall_timeout_s=STALL_S, handshake_timeout_s=HANDSHAKE_S,
                                        quarantine_s=QUARANTINE_S, metrics_port=ports[name])
        config["kv_load_failure_policy"] = policy
        return VllmServerSpec(model=smollm2_dir, port=vllm_servers.http_port(), block_size=block, cores=cores,
                              enforce_eager=True,
                              kv_transfer_config=config, env={"KVLINK_SECRET": secret}, name=f"kvlink-{name}")

    specs = [spec("a", 128, "0", "fail"), spec("b", 128, "1", "fail"),
             spec("c", 32, "0", "recompute"), spec("e", 32, "1", "fail")]
    return specs, ports


def test_unknown_extra_config_key_refuses_to_start(vllm_servers: VllmServers, smollm2_dir: Path,
                                                   colocated: Colocated,
                                                   pd_specs: tuple[list[VllmServerSpec], dict[str, int]]) -> None:
    """(Three of the module's P/D servers start meanwhile: four servers at most.)"""
    config = kvlink_transfer_config(vllm_servers.side_channel_port(), lease_second=5)
    spec = VllmServerSpec(model=smollm2_dir, port=vllm_servers.http_port(), cores="1", kv_transfer_config=config,
                          enforce_eager=True, env={"KVLINK_SECRET": new_secret()}, name="kvlink-bad-config")
    with pytest.raises(RuntimeError):
        vllm_servers.start(spec, timeout_s=240, alongside=pd_specs[0][:3])
    log = (vllm_servers.log_dir / "kvlink-bad-config.log").read_text(errors="replace")
    assert "unknown kv_connector_extra_config keys ['lease_second']" in log
    assert "known keys:" in log and "lease_s" in log


@pytest.fixture(scope="module")
def pd(vllm_servers: VllmServers, pd_specs: tuple[list[VllmServerSpec], dict[str, int]],
       colocated: Colocated) -> Iterator[PD]:
    specs, ports = pd_specs
    a, b, c, e = vllm_servers.start(*specs)
    yield PD(a, b, c, e, ports, served_model(a.url))
    vllm_servers.stop(a, b, c, e)


def shipped_bytes(pd: PD, prompt: str, p_block: int, d_block: int) -> int:
    """KV bytes D reads for a fresh prompt: whole blocks; between different block sizes whole P
    blocks, read into D's staging pages and re-laid out there."""
    tokens = len(httpx.post(pd.b.url + "/tokenize", json={"model": pd.model, "prompt": prompt}, timeout=10)
                 .json()["tokens"])
    return -(-(tokens - 1) // p_block) * p_block * PAGE_BYTES_PER_TOKEN  # D recomputes the last token


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_same_block_size_equals_colocated(pd: PD, colocated: Colocated, index: int) -> None:
    prompt = "(128->128) " + PROMPTS[index]
    checked = vllm_metric(pd.b, VERIFIED)
    text, nbytes = pd.run(pd.a, pd.b, prompt)
    assert text == colocated(prompt)
    assert nbytes == shipped_bytes(pd, prompt, 128, 128)
    assert wait_metric(pd.b.url, VERIFIED, checked) > checked  # D checked P's digests


# Between different block sizes D reads whole P blocks into staging pages and re-lays them
# out (K is transposed inside vLLM's CPU blocks, so token slices of a block are not runs).
@pytest.mark.parametrize("direction", ["32->128", "128->32"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_different_block_sizes_equal_colocated(pd: PD, colocated: Colocated, direction: str, index: int) -> None:
    p, d, sizes = (pd.c, pd.b, (32, 128)) if direction == "32->128" else (pd.a, pd.e, (128, 32))
    prompt = f"({direction}) " + PROMPTS[index]
    checked = vllm_metric(d, VERIFIED)
    text, nbytes = pd.run(p, d, prompt)
    assert text == colocated(prompt)
    assert nbytes == shipped_bytes(pd, prompt, *sizes)
    assert wait_metric(d.url, VERIFIED, checked) > checked  # in the staging pages, before the re-layout


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_push_mode_equals_colocated(pd: PD, colocated: Colocated, index: int) -> None:
    prompt = "(push 128->128) " + PROMPTS[index]
    checked = vllm_metric(pd.b, VERIFIED)
    assert pd.run(pd.a, pd.b, prompt, mode="push")[0] == colocated(prompt)
    assert wait_metric(pd.b.url, VERIFIED, checked) > checked  # P's digests, read after `pushed`


# P's WRITE cannot re-layout between block sizes: D turns the push into a staged pull, which
# its connector counts (push_as_staged_pull_total on the worker's /metrics).
@pytest.mark.parametrize("direction", ["32->128", "128->32"])
@pytest.mark.parametrize("index", [1, 3])
def test_push_between_block_sizes_equals_colocated(pd: PD, colocated: Colocated, direction: str,
                                                   index: int) -> None:
    p, d, name = (pd.c, pd.b, "b") if direction == "32->128" else (pd.a, pd.e, "e")
    prompt = f"(push {direction}) " + PROMPTS[index]
    before = worker_counter(pd, name, "push_as_staged_pull_total")
    checked = vllm_metric(d, VERIFIED)
    text, nbytes = pd.run(p, d, prompt, mode="push", d_reads=True)
    assert text == colocated(prompt)
    assert wait_metric(d.url, VERIFIED, checked) > checked
    deadline = time.monotonic() + 5  # the worker's counters reach its /metrics with the next step
    while worker_counter(pd, name, "push_as_staged_pull_total") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_counter(pd, name, "push_as_staged_pull_total") == before + 1
    assert nbytes == shipped_bytes(pd, prompt, int(direction.split("->")[0]), int(direction.split("->")[1]))


def test_d_prefix_hit_moves_only_the_tail(pd: PD, colocated: Colocated) -> None:
    prompt = "(prefix) " + PROMPTS[3]
    first_text, first_bytes = pd.run(pd.a, pd.b, prompt)
    second_text, second_bytes = pd.run(pd.a, pd.b, prompt)
    assert second_text == first_text == colocated(prompt)
    tokens = len(httpx.post(pd.b.url + "/tokenize", json={"model": pd.model, "prompt": prompt}, timeout=10)
                 .json()["tokens"])
    shipped = tokens - 1  # D recomputes the last prompt token
    # Same block size: whole blocks move; D's second time hits every full block of the prompt.
    assert first_bytes == -(-shipped // 128) * 128 * PAGE_BYTES_PER_TOKEN
    hit_blocks = (tokens - 1) // 128
    assert second_bytes == (-(-shipped // 128) - hit_blocks) * 128 * PAGE_BYTES_PER_TOKEN
    assert second_bytes < first_bytes


@pytest.mark.parametrize("kind", ["kvlink", "vllm-router"])
def test_behind_a_router(pd: PD, colocated: Colocated, kind: str, tmp_path: Path) -> None:
    if kind == "vllm-router":
        assert vllm_router_executable() is not None, "vllm-router is a dev dependency"
    port = free_port()
    router = start_process(f"router-{kind}", router_argv(kind, [pd.a.url], [pd.b.url], port, 60.0,
                                                        metrics_port=free_port()),
                           f"http://127.0.0.1:{port}", tmp_path)
    try:
        wait_healthy([router], 60)
        for index in (0, 2):
            prompt = f"(via {kind}) " + PROMPTS[index]
            before = vllm_metric(pd.b, "vllm:kvlink_bytes_transferred_count")
            resp = httpx.post(router.url + "/v1/completions", timeout=60, json={
                "model": pd.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == colocated(prompt), router.log_tail()
            deadline = time.monotonic() + 5
            while vllm_metric(pd.b, "vllm:kvlink_bytes_transferred_count") == before:
                assert time.monotonic() < deadline, "D loaded nothing: the router did not go through P"
                time.sleep(0.1)
    finally:
        stop_all([router])


def layerwise_via_proxy(pd: PD, colocated: Colocated, p: Service, d: Service, tag: str,
                        indices: list[int], tmp_path: Path) -> list[float]:
    """Ask `kvlink proxy --mode layerwise` in front of P and D for `({tag}) PROMPTS[i]`; every
    answer equals colocated vLLM's, and D read nothing of the layerwise ones (all but the
    first: vLLM P has no /v1/kv_endpoint, the proxy learns P's side channel from a classic
    answer). P's WRITEs per layerwise request; the last one went with P held until D asked."""
    port = free_port()
    router = start_process("router-layerwise", router_argv("kvlink", [p.url], [d.url], port, 60.0,
                                                          extra_args=["--mode", "layerwise"]),
                           f"http://127.0.0.1:{port}", tmp_path)
    try:
        wait_healthy([router], 60)
        writes = []
        for n, index in enumerate(indices):
            prompt = f"({tag}) " + PROMPTS[index]
            read_before = vllm_metric(d, "vllm:kvlink_bytes_transferred_count")
            wrote_before = vllm_metric(p, "vllm:kvlink_bytes_transferred_count")
            def send(prompt: str = prompt) -> httpx.Response:
                return httpx.post(router.url + "/v1/completions", timeout=60, json={
                    "model": pd.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True})
            # The last one goes with P held until D asked: its prefill streams whatever the load.
            resp = with_p_held(p, d, send) if n and n == len(indices) - 1 else send()
            assert resp.status_code == 200, resp.text + router.log_tail()
            assert resp.json()["choices"][0]["text"] == colocated(prompt)
            deadline = time.monotonic() + 5
            while vllm_metric(p, "vllm:kvlink_bytes_transferred_count") == wrote_before and n:
                assert time.monotonic() < deadline, "P wrote nothing for a layerwise request"
                time.sleep(0.1)
            if n:  # the first one went the classic way (pull): D read it
                assert vllm_metric(d, "vllm:kvlink_bytes_transferred_count") == read_before
            writes.append(vllm_metric(p, "vllm:kvlink_bytes_transferred_count") - wrote_before)
        log = router.log_tail()
        assert "has no /v1/kv_endpoint" in (tmp_path / "router-layerwise.log").read_text(errors="replace"), log
    finally:
        stop_all([router])
    print(f"P's WRITEs per layerwise request ({tag}): {writes[1:]}")
    return writes[1:]


def test_layerwise_through_kvlink_proxy_equals_colocated(pd: PD, colocated: Colocated, tmp_path: Path) -> None:
    """`kvlink proxy --mode layerwise` in front of vLLM P and D: D asks P, and P WRITEs each
    attention layer's finished blocks from vLLM's `save_kv_layer` (the rest with `pushed`)."""
    writes = layerwise_via_proxy(pd, colocated, pd.a, pd.b, "layerwise", list(range(len(PROMPTS))), tmp_path)
    # One WRITE per attention layer while P's forward runs, when D asked before it ended (it
    # may ask later, under load: then one WRITE after the prefill, still exact). The last
    # request went with P held until D had asked: its forward streamed.
    assert writes[-1] > 1, f"P never wrote during a forward: {writes}"
    for name, server in (("a", pd.a), ("b", pd.b)):
        wait_idle(pd, server, name, 20)


# Between block sizes P WRITEs whole P blocks into D's staging pages, layer by layer, and D
# re-lays them out once P says `pushed` (as after a staged pull).
@pytest.mark.parametrize("direction", ["32->128", "128->32"])
def test_layerwise_between_block_sizes_equals_colocated(pd: PD, colocated: Colocated, direction: str,
                                                        tmp_path: Path) -> None:
    p, d, names = (pd.c, pd.b, ("c", "b")) if direction == "32->128" else (pd.a, pd.e, ("a", "e"))
    staged = worker_counter(pd, names[1], "staged_loads_total")
    writes = layerwise_via_proxy(pd, colocated, p, d, f"layerwise {direction}", LAYERWISE_STAGED, tmp_path)
    assert writes[-1] > 1, f"P never wrote during a forward (the last one with P held): {writes}"
    deadline = time.monotonic() + 5  # the worker's counters reach its /metrics with the next step
    while worker_counter(pd, names[1], "staged_loads_total") < staged + len(LAYERWISE_STAGED):
        assert time.monotonic() < deadline, "D did not load every request through its staging pages"
        time.sleep(0.1)
    for name, server in zip(names, (p, d), strict=True):
        wait_idle(pd, server, name, 20)


def test_kv_transfer_metrics_line_and_worker_counters(pd: PD) -> None:
    prompt = "(metrics) " + PROMPTS[1]
    rereads = worker_counter(pd, "b", "kv_digest_rereads_total")
    params = pd.prefill(pd.a, prompt)
    # What P holds for D right now reaches vLLM's /metrics with P's next steps.
    assert wait_metric(pd.a.url, "vllm:kvlink_pending_sends", 0) == 1
    tokens = len(httpx.post(pd.a.url + "/tokenize", json={"model": pd.model, "prompt": prompt}, timeout=10)
                 .json()["tokens"])
    assert vllm_metric(pd.a, "vllm:kvlink_pending_send_blocks") == -(-tokens // 128)
    resp = pd.decode(pd.b, prompt, params)
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 10
    while vllm_metric(pd.a, "vllm:kvlink_pending_sends") != 0:
        assert time.monotonic() < deadline, "P's gauge still shows the request D has read"
        time.sleep(0.1)
    assert vllm_metric(pd.a, "vllm:kvlink_pending_send_blocks") == 0
    log = pd.b.log_path.read_text(errors="replace")
    deadline = time.monotonic() + 15  # vLLM logs its stats every 10 s
    while "KV Transfer metrics: Num successful transfers=" not in log and time.monotonic() < deadline:
        time.sleep(0.5)
        log = pd.b.log_path.read_text(errors="replace")
    assert "KV Transfer metrics: Num successful transfers=" in log
    assert "Num KV checksum mismatches=0" in log
    assert "kvlink load " in log  # one line per request with its transfer figures
    text = httpx.get(f"http://127.0.0.1:{pd.metrics_ports['b']}/metrics", timeout=5).text
    assert "kvlink_transfers_total" in text and "kvlink_loads_in_flight" in text
    assert "kvlink_kv_verified_units_total" in text
    # D's /metrics: handshakes per remote engine, integrity and lease counters (each its own).
    p_engine = f'remote_engine="{params["remote_engine_id"]}"'
    assert vllm_metric(pd.b, "vllm:kvlink_handshakes_total", p_engine) >= 1
    assert vllm_metric(pd.b, VERIFIED) > 0 and vllm_metric(pd.b, "vllm:kvlink_kv_verified_bytes_total") > 0
    series = httpx.get(pd.b.url + "/metrics", timeout=10).text
    for name in ("kv_checksum_mismatch_total", "kv_digest_rereads_total", "kv_unsealed_loads_total",
                 "kv_unverifiable_units_total", "expired_leases_total", "failed_transfers_total",
                 "failed_handshakes_total", "pending_sends", "pending_send_blocks"):
        assert f"vllm:kvlink_{name}{{" in series, name
    assert vllm_metric(pd.b, "vllm:kvlink_kv_checksum_mismatch_total") == 0
    # P sealed the request right after the forward that completed its prefill, before its
    # answer left: D's first digest READ found the seals (no re-read).
    assert worker_counter(pd, "b", "kv_digest_rereads_total") == rereads
    assert worker_counter(pd, "a", "kv_early_seals_total") >= 1


# ---- faults (last: they freeze and kill servers) ------------------------------------------
def test_p_frozen_after_prefill(pd: PD, colocated: Colocated) -> None:
    """P's workers stopped (SIGSTOP) after its prefill answered.

    Pull: over CMA the kernel still reads a stopped process, and P's lease keeps the blocks
    for D, so D usually answers the right text (B, policy fail; C, policy recompute, through
    its staging pages) and P frees when it runs again; a READ that waits for P anyway (the
    first ones to a new peer finish UCX's wire-up; seen once more in a full module run)
    hits the stall deadline: B answers an error, C the right text. Push: a stopped P cannot write, so D hits
    its deadline (stall + handshake): B answers an error, C (pushed to by E, block 32)
    prefills itself and answers the right text. A stalled load reaches vLLM only after
    `quarantine_s` more (vLLM frees or recomputes into its blocks at once, and a frozen P may
    still deliver into them): the push answers come no sooner than deadline + quarantine."""
    # Connected first: the first READs to a new peer finish UCX's wire-up, which needs P.
    for i in range(2):
        pd.run(pd.a, pd.b, f"(warm {i}) " + PROMPTS[0])
        pd.run(pd.a, pd.c, f"(warm {i}) " + PROMPTS[0])
    pd.run(pd.e, pd.c, "(warm push) " + PROMPTS[0], "push")
    pull_b, pull_c = "(frozen) " + PROMPTS[2], "(frozen, recompute) " + PROMPTS[2]
    push_b, push_c = "(frozen push) " + PROMPTS[1], "(frozen push, recompute) " + PROMPTS[1]
    params = {"pull_b": pd.prefill(pd.a, pull_b), "pull_c": pd.prefill(pd.a, pull_c),
              "push_b": pd.prefill(pd.a, push_b, "push"), "push_c": pd.prefill(pd.e, push_c, "push")}
    frozen = workers_of(pd.a) + workers_of(pd.e)
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    asked = {"pull_b": (pd.b, pull_b), "pull_c": (pd.c, pull_c), "push_b": (pd.b, push_b), "push_c": (pd.c, push_c)}
    try:
        with ThreadPoolExecutor(len(asked)) as pool:
            def timed(key: str) -> tuple[httpx.Response, float]:
                started = time.monotonic()
                server, prompt = asked[key]
                return pd.decode(server, prompt, params[key]), time.monotonic() - started
            futures = {key: pool.submit(timed, key) for key in asked}
            answers = {key: future.result() for key, future in futures.items()}
    finally:
        for proc in frozen:
            proc.send_signal(signal.SIGCONT)
    # A pull usually completes (the right text) but may also stall (seen once in a full module
    # run; most likely a UCX control message pending on the endpoint): then the deadline applies.
    resp, took = answers["pull_b"]
    assert took < STALL_S + QUARANTINE_S + 15, ("pull_b", resp.status_code, took)
    assert resp.status_code >= 500 or (resp.status_code == 200 and
                                       resp.json()["choices"][0]["text"] == colocated(pull_b)), resp.text[:300]
    resp, took = answers["pull_c"]  # policy recompute: the right text, read or recomputed
    assert resp.status_code == 200 and took < STALL_S + QUARANTINE_S + 20, ("pull_c", resp.status_code, took,
                                                                           resp.text[:300])
    assert resp.json()["choices"][0]["text"] == colocated(pull_c)
    print(f"[frozen P] pull answers: B HTTP {answers['pull_b'][0].status_code} after "
          f"{answers['pull_b'][1]:.1f} s, C after {answers['pull_c'][1]:.1f} s")
    held = STALL_S + HANDSHAKE_S + QUARANTINE_S  # the push deadline, then the quarantine
    resp, took = answers["push_b"]  # policy fail: an error, bounded by the push deadline
    assert resp.status_code >= 500 and held - 1 < took < held + 15, (resp.status_code, took)
    resp, took = answers["push_c"]  # policy recompute: the right text
    assert resp.status_code == 200 and held - 1 < took < held + 20, (resp.status_code, took, resp.text[:300])
    for server in (pd.b, pd.c):
        assert "stalled: its blocks stay with the request for 5 s" in server.log_path.read_text(errors="replace")
    assert resp.json()["choices"][0]["text"] == colocated(push_c)
    for server, name in ((pd.a, "a"), (pd.b, "b"), (pd.c, "c"), (pd.e, "e")):
        wait_idle(pd, server, name, within_s=LEASE_S + HANDSHAKE_S + 10)


def test_client_leaving_during_a_stalled_load_s_quarantine_keeps_the_blocks(pd: PD) -> None:
    """A push from a frozen P stalls at D's deadline, and the client leaves during the
    quarantine that follows. Without the hold, B (policy fail) would answer an error at the
    deadline and vLLM would free the blocks; with it the client is still waiting when it
    leaves, vLLM keeps the aborted request's blocks until the load is reported over, and B
    frees them at the quarantine's end. Nothing leaks."""
    prompt = "(stalled, client leaves) " + PROMPTS[1]
    params = pd.prefill(pd.a, prompt, "push")
    deadline = STALL_S + HANDSHAKE_S
    frozen = workers_of(pd.a)
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(httpx.TimeoutException):  # the client leaves 1.5 s into the hold
            pd.decode(pd.b, prompt, params, timeout_s=deadline + 1.5)
        assert time.monotonic() - started < deadline + QUARANTINE_S - 1
        assert vllm_metric(pd.b, "vllm:kv_cache_usage_perc") > 0, "B freed while P could still write"
        wait_idle(pd, pd.b, "b", within_s=QUARANTINE_S + 10)
        assert time.monotonic() - started > deadline + QUARANTINE_S - 1, "B freed before the quarantine ended"
    finally:
        for proc in frozen:
            proc.send_signal(signal.SIGCONT)
    wait_idle(pd, pd.a, "a", within_s=LEASE_S + 10)


def test_client_leaving_d_mid_load_frees_p_at_once(pd: PD) -> None:
    prompt = "(client leaves) " + PROMPTS[3]
    params = pd.prefill(pd.a, prompt)
    with pytest.raises(httpx.TimeoutException):
        pd.decode(pd.b, prompt, params, timeout_s=0.05)
    assert wait_idle(pd, pd.a, "a", within_s=LEASE_S - 3) < LEASE_S - 3  # well before the lease ends
    wait_idle(pd, pd.b, "b", within_s=10)


def test_client_leaving_a_layerwise_request_frees_d_once_p_stopped(pd: PD, colocated: Colocated) -> None:
    """The client leaves a layerwise request while D waits for P's layers (P's workers
    stopped): vLLM aborts it on D, which keeps the blocks while P could still write into
    them (vLLM frees them as soon as the load is reported over). D asks P to stop; P, running again, reads the cancel at its next step
    (vLLM does not step an idle engine, so that is its next request) and answers; D frees,
    long before its layerwise deadline (stall + handshake + 60 s). Nothing leaks, and B
    answers the same prompt exactly afterwards."""
    prompt = "(client leaves, layerwise) " + PROMPTS[2]
    known = pd.prefill(pd.a, "(client leaves, warm) " + PROMPTS[0])  # A's side channel, as a proxy learns it
    assert pd.decode(pd.b, "(client leaves, warm) " + PROMPTS[0], known).status_code == 200
    wait_idle(pd, pd.a, "a", 20)
    params = {key: known[key] for key in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}
    params.update(do_remote_prefill=True, transfer_mode="layerwise", remote_request_id="client-leaves-1",
                  remote_block_ids=[])
    cancelled = worker_counter(pd, "b", "cancelled_loads_total")
    frozen = workers_of(pd.a)
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(httpx.TimeoutException):
            pd.decode(pd.b, prompt, params, timeout_s=2.0)
        deadline = time.monotonic() + 10
        while worker_counter(pd, "b", "cancelled_loads_total") == cancelled:
            assert time.monotonic() < deadline, "D never asked P to stop"
            time.sleep(0.2)
        time.sleep(1.0)
        assert vllm_metric(pd.b, "vllm:kv_cache_usage_perc") > 0, "D freed while P could still write"
    finally:
        for proc in frozen:
            proc.send_signal(signal.SIGCONT)
    # vLLM steps an idle engine never: A reads D's cancel at its next step, its next request.
    time.sleep(2.0)
    assert vllm_metric(pd.b, "vllm:kv_cache_usage_perc") > 0, "D freed before P answered"
    resumed = time.monotonic()
    following = pd.prefill(pd.a, "(client leaves, next) " + PROMPTS[1])
    took = wait_idle(pd, pd.b, "b", within_s=20)
    print(f"[client left, layerwise] D idle {took:.1f} s after P's next request "
          f"({time.monotonic() - resumed:.1f} s with it)")
    assert pd.decode(pd.b, "(client leaves, next) " + PROMPTS[1], following).status_code == 200
    wait_idle(pd, pd.a, "a", within_s=20)
    assert worker_counter(pd, "a", "cancelled_pushes_total") >= 1
    assert pd.run(pd.a, pd.b, prompt)[0] == colocated(prompt)


def test_p_killed_after_prefill(pd: PD, colocated: Colocated) -> None:
    prompt, other = "(killed) " + PROMPTS[1], "(killed, recompute) " + PROMPTS[1]
    for_b, for_c = pd.prefill(pd.a, prompt), pd.prefill(pd.a, other)
    expected = colocated(other)
    os.killpg(pd.a.proc.pid, signal.SIGKILL)
    pd.a.proc.wait(timeout=30)
    started = time.monotonic()
    failed = pd.decode(pd.b, prompt, for_b)
    assert failed.status_code >= 500 and time.monotonic() - started < STALL_S + 15
    started = time.monotonic()
    recomputed = pd.decode(pd.c, other, for_c)
    assert recomputed.status_code == 200 and time.monotonic() - started < STALL_S + 20
    assert recomputed.json()["choices"][0]["text"] == expected
    # vLLM hands the failed request back (pre-aborted) so D tells P to free: a notification to
    # a dead P, given up after the handshake deadline.
    wait_idle(pd, pd.b, "b", within_s=HANDSHAKE_S + 10)
    wait_idle(pd, pd.c, "c", within_s=HANDSHAKE_S + 10)


def test_d_killed_while_p_holds_blocks(pd: PD) -> None:
    pd.prefill(pd.c, "(d killed) " + PROMPTS[3])  # C is P now; B, the D it was meant for, dies before reading
    os.killpg(pd.b.proc.pid, signal.SIGKILL)
    pd.b.proc.wait(timeout=30)
    assert vllm_metric(pd.c, "vllm:kv_cache_usage_perc") > 0
    freed_after = wait_idle(pd, pd.c, "c", within_s=LEASE_S + 10)
    assert freed_after > LEASE_S - 3  # held for the lease, then freed
