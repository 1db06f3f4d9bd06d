"""Corrupted KV is never decoded: SmolLM2 P -> proxy -> D as real processes, faults injected on purpose.

P and D run with `KVLINK_TEST_FAULT` in their environment (`kvlink.connector.sealer`): P flips
a byte of a request's KV after sealing it (`flip_after_seal`), or frees its blocks at once so
another prompt overwrites them before D reads (`free_after_seal`); D leaves one descriptor out
of every READ (`skip_descriptor`). With `--verify-kv full` on D a corrupted load fails: policy
`fail` answers a retryable 502 `kv_load_failed` (through the proxy too), policy `recompute`
answers the colocated instance's greedy text. With `--verify-kv off` the same faults are
decoded from; those cases assert a 200 and print whether the text changed (RELIABILITY.md).
One deployment for the module (P, D, proxy, colocated); P and D are restarted per case with
the fault and options it needs. After each case every pool is whole, nothing is held.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from e2e_helpers import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    START_TIMEOUT_S,
    assert_clean,
    cluster_for,
    completion_text,
)

from kvlink.bench.cluster import Cluster, ClusterSpec
from kvlink.connector.sealer import FAULT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m"
MAX_TOKENS = 12
SMALL_P_BLOCKS = 8  # P's pool under free_after_seal: the next long prompt takes every block
STALL_S = 3.0
VOCAB = 49152


def prompt(topic: str) -> str:
    """About 42 tokens (3 blocks) that SmolLM2 goes on with; the topic comes first, so no two
    cases share a cached block."""
    return (f"{topic} is the subject of this short story, told in plain words with a beginning, a middle "
            f"and an end. Once upon a time, in a small town by the sea, there was a {topic.lower()} that")


@dataclass
class Deployment:
    """The running cluster and what each instance was last started with."""

    cluster: Cluster
    started: dict[str, tuple[str | None, tuple[str, ...]]] = field(default_factory=dict)
    expected: dict[str, str] = field(default_factory=dict)

    def use(self, which: str, fault: str | None = None, args: tuple[str, ...] = ()) -> None:
        """Restart `prefill` or `decode` with this fault and these extra serve arguments,
        unless it runs with them already."""
        if self.started.get(which, (None, ())) == (fault, args):
            return
        member = self.cluster.member(which)
        member.env.pop(FAULT_ENV, None)
        if fault is not None:
            member.env[FAULT_ENV] = fault
        self.cluster.restart(which, timeout_s=START_TIMEOUT_S, extra_args=list(args))
        self.started[which] = (fault, args)

    def url(self, which: str) -> str:
        return self.cluster.service(which).url

    def colocated_text(self, text: str) -> str:
        if text not in self.expected:
            want, _ = completion_text(self.url("colocated"), text, MAX_TOKENS)
            assert want, "the colocated instance answered an empty text"
            self.expected[text] = want
        return self.expected[text]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    spec = ClusterSpec(model=MODEL, num_blocks=NUM_BLOCKS, prefill_block_size=BLOCK_SIZE,
                       decode_block_size=BLOCK_SIZE, colocated=True, request_timeout_s=60.0,
                       stall_timeout_s=STALL_S, decode_args=("--verify-kv", "full"))
    for cluster in cluster_for(spec, tmp_path_factory, "integrity"):
        yield Deployment(cluster)


def metrics(url: str) -> dict[str, float]:
    """`/metrics` as {name or name{labels}: value}."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$", line)
        if match:
            out[match.group(1)] = float(match.group(2))
    return out


def wait_metric(url: str, name: str, value: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := metrics(url).get(name)) != value:
        assert time.monotonic() < deadline, f"{url}: {name} is {seen}, expected {value} within {timeout_s}s"
        time.sleep(0.2)


def post(url: str, body: dict[str, object], request_id: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"temperature": 0, **body}, timeout=60,
                      headers={"X-Request-Id": request_id})


def through_proxy(d: Deployment, text: str, request_id: str) -> httpx.Response:
    return post(d.url("proxy"), {"prompt": text, "max_tokens": MAX_TOKENS}, request_id)


def log_line(d: Deployment, request_id: str) -> str:
    service = d.cluster.service("decode")
    deadline = time.monotonic() + 5
    while True:
        lines = [line for line in service.log_path.read_text(errors="replace").splitlines()
                 if f"request {request_id} role=decode" in line]
        if lines:
            return lines[-1]
        assert time.monotonic() < deadline, f"no log line of {request_id} in {service.log_path}"
        time.sleep(0.1)


def assert_retryable_checksum_failure(response: httpx.Response, p_engine: str, through: str,
                                      units: str = r"\d+") -> str:
    """D's 502 `kv_load_failed` (the proxy keeps status and code), naming the mismatch and P."""
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "kv_load_failed", error
    named = rf"KV checksum mismatch in {units} unit\(s\) from {re.escape(p_engine)} rank 0 \(group 0 block \d+"
    assert re.search(named, error["message"]), error
    assert "retry the request" in error["message"], error
    if through == "proxy":
        assert error["message"].startswith("decode instance http://"), error
    return str(error["message"])


def report(case: str, got: str, want: str) -> None:
    same = "the same text as colocated" if got == want else "a different text from colocated"
    print(f"\n[{case}] HTTP 200 with {same}: {got!r} (colocated {want!r})")


# ---- a correct load, checked: figures on a real server --------------------------------------

def test_checked_load_shows_in_metrics_log_line_and_answer(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill")
    d.use("decode")
    p_url, d_url = d.url("prefill"), d.url("decode")
    p_engine = d.cluster.member("prefill").engine_id
    before = metrics(d_url)
    for name in ("kvlink_kv_checksum_mismatch_total", "kvlink_kv_verified_bytes_total",
                 "kvlink_kv_unsealed_loads_total", "kvlink_loads_in_flight", "kvlink_pending_sends"):
        assert before.get(name) == 0, (name, before.get(name))  # there, at 0, before any request
    assert metrics(p_url)["kvlink_kv_sealed_bytes_total"] == 0

    text = prompt("Lighthouse")
    held = post(p_url, {"prompt": text, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
                "checked-p")
    assert held.status_code == 200, held.text
    blocks = sum(len(ids) for ids in held.json()["kv_transfer_params"]["remote_block_ids"])
    wait_metric(p_url, "kvlink_pending_sends", 1)
    assert metrics(p_url)["kvlink_pending_send_blocks"] == blocks
    sealed = metrics(p_url)["kvlink_kv_sealed_bytes_total"]
    assert sealed > 0

    answer = post(d_url, {"prompt": text, "max_tokens": MAX_TOKENS,
                          "kv_transfer_params": held.json()["kv_transfer_params"]}, "checked-d")
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == d.colocated_text(text)
    figures = answer.json()["kvlink"]
    verified = figures["kv_verified_bytes"]
    assert 0 < verified <= figures["kv_bytes"] and verified <= sealed
    line = log_line(d, "checked-d")
    assert f" kv_bytes={figures['kv_bytes']} " in line and f" kv_verified_bytes={verified}" in line, line

    after = metrics(d_url)
    assert after["kvlink_kv_verified_bytes_total"] == verified
    assert after["kvlink_kv_verified_units_total"] > 0 and after["kvlink_kv_checksum_mismatch_total"] == 0
    assert after[f'kvlink_handshakes_total{{remote_engine="{p_engine}"}}'] == 1
    assert after["kvlink_loads_in_flight"] == 0
    wait_metric(p_url, "kvlink_pending_sends", 0)
    assert metrics(p_url)["kvlink_pending_send_blocks"] == 0
    print(f"\n[checked load] {figures['kv_bytes']} KV bytes loaded, {verified} checked; log: "
          f"{line.split('role=')[1]}")
    assert_clean(d.cluster)


# ---- flip_after_seal: a byte of P's KV changes after P sealed it -----------------------------

def test_flipped_byte_is_a_retryable_502_through_the_proxy(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill", "flip_after_seal")
    d.use("decode")
    p_engine = str(d.cluster.member("prefill").engine_id)
    response = through_proxy(d, prompt("Bread"), "flip-fail")
    message = assert_retryable_checksum_failure(response, p_engine, "proxy", units="1")
    assert metrics(d.url("decode"))["kvlink_kv_checksum_mismatch_total"] == 1
    assert metrics(d.url("decode"))['kvlink_server_requests_total{outcome="error"}'] == 1
    assert "finish=error" in log_line(d, "flip-fail")
    assert metrics(d.url("proxy"))['kvlink_proxy_requests_total{outcome="kv_load_failed"}'] == 1
    print(f"\n[flip_after_seal, verify full, fail] HTTP 502 kv_load_failed: {message}")
    assert_clean(d.cluster)


def test_flipped_byte_is_recomputed_to_the_colocated_text(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill", "flip_after_seal")
    d.use("decode", args=("--load-failure-policy", "recompute"))
    text = prompt("Glacier")
    response = through_proxy(d, text, "flip-recompute")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == d.colocated_text(text)
    assert metrics(d.url("decode"))["kvlink_kv_checksum_mismatch_total"] == 1
    print("\n[flip_after_seal, verify full, recompute] HTTP 200 with the colocated text")
    assert_clean(d.cluster)


def test_flipped_byte_unchecked_is_decoded_from(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill", "flip_after_seal")
    d.use("decode", args=("--verify-kv", "off"))
    text = prompt("Orchard")
    response = through_proxy(d, text, "flip-off")
    assert response.status_code == 200, response.text
    assert "kv_verified_bytes" not in response.json()["kvlink"]
    counted = metrics(d.url("decode"))
    assert counted["kvlink_kv_verified_units_total"] == 0 and counted["kvlink_kv_checksum_mismatch_total"] == 0
    report("flip_after_seal, verify off", response.json()["choices"][0]["text"], d.colocated_text(text))
    assert_clean(d.cluster)


# ---- free_after_seal: P frees the blocks at once and another prompt overwrites them ----------

def reused_blocks_answer(d: Deployment, topic: str, seed: int) -> tuple[str, httpx.Response]:
    """Prefill leg to P; a long prompt that takes every block of P (so it overwrites the first
    prompt's); then the decode leg to D with the first prompt's params."""
    p_url = d.url("prefill")
    text = prompt(topic)
    prefilled = post(p_url, {"prompt": text, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
                     f"reuse-{seed}-p")
    assert prefilled.status_code == 200, prefilled.text
    params = prefilled.json()["kv_transfer_params"]
    deadline = time.monotonic() + 10
    while (state := httpx.get(f"{p_url}/debug/state", timeout=10).json()["engine"])["held_requests"]:
        assert time.monotonic() < deadline, f"P did not free the prefilled blocks at once: {state}"
        time.sleep(0.1)
    rng = random.Random(seed)
    filler_tokens = SMALL_P_BLOCKS * BLOCK_SIZE - 8
    filler = post(p_url, {"prompt": [rng.randrange(100, VOCAB) for _ in range(filler_tokens)], "max_tokens": 8},
                  f"reuse-{seed}-filler")
    assert filler.status_code == 200, filler.text
    return text, post(d.url("decode"), {"prompt": text, "max_tokens": MAX_TOKENS, "kv_transfer_params": params},
                      f"reuse-{seed}-d")


FREE_P = ("free_after_seal", ("--num-blocks", str(SMALL_P_BLOCKS)))


def test_reused_blocks_fail_the_load(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill", *FREE_P)
    d.use("decode")
    _, response = reused_blocks_answer(d, "Harbor", 1)
    message = assert_retryable_checksum_failure(response, str(d.cluster.member("prefill").engine_id), "decode")
    print(f"\n[free_after_seal, verify full, fail] HTTP 502 kv_load_failed: {message}")
    assert_clean(d.cluster)


def test_reused_blocks_are_recomputed_to_the_colocated_text(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill", *FREE_P)
    d.use("decode", args=("--load-failure-policy", "recompute"))
    text, response = reused_blocks_answer(d, "Meadow", 2)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == d.colocated_text(text)
    assert metrics(d.url("decode"))["kvlink_kv_checksum_mismatch_total"] == 1
    print("\n[free_after_seal, verify full, recompute] HTTP 200 with the colocated text")
    assert_clean(d.cluster)


def test_reused_blocks_unchecked_are_decoded_from(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill", *FREE_P)
    d.use("decode", args=("--verify-kv", "off"))
    text, response = reused_blocks_answer(d, "Volcano", 3)
    assert response.status_code == 200, response.text
    report("free_after_seal, verify off", response.json()["choices"][0]["text"], d.colocated_text(text))
    assert_clean(d.cluster)


# ---- skip_descriptor: D's READ leaves one descriptor out (a truncated transfer) --------------

def test_truncated_read_is_a_retryable_502(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill")
    d.use("decode", "skip_descriptor")
    response = through_proxy(d, prompt("Lantern"), "skip-fail")
    message = assert_retryable_checksum_failure(response, str(d.cluster.member("prefill").engine_id), "proxy")
    print(f"\n[skip_descriptor, verify full, fail] HTTP 502 kv_load_failed: {message}")
    assert_clean(d.cluster)


def test_truncated_read_unchecked_is_decoded_from(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill")
    d.use("decode", "skip_descriptor", ("--verify-kv", "off"))
    text = prompt("Compass")
    response = through_proxy(d, text, "skip-off")
    assert response.status_code == 200, response.text
    report("skip_descriptor, verify off", response.json()["choices"][0]["text"], d.colocated_text(text))
    assert_clean(d.cluster)


# ---- push mode: P writes into D's blocks, D reads the digests once P says `pushed` ----------

PUSH = ("--transfer-mode", "push")


def test_checked_push_load_reports_verified_bytes(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill", args=PUSH)
    d.use("decode", args=PUSH)
    text = prompt("Windmill")
    response = through_proxy(d, text, "push-checked")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == d.colocated_text(text)
    figures = response.json()["kvlink"]
    assert 0 < figures["kv_verified_bytes"] <= figures["kv_bytes"]
    assert f" kv_verified_bytes={figures['kv_verified_bytes']}" in log_line(d, "push-checked")
    assert metrics(d.url("decode"))["kvlink_kv_verified_bytes_total"] == figures["kv_verified_bytes"]
    assert_clean(d.cluster)


def test_flipped_byte_pushed_is_a_retryable_502(deployment: Deployment) -> None:
    d = deployment
    d.use("prefill", "flip_after_seal", PUSH)
    d.use("decode", args=PUSH)
    response = through_proxy(d, prompt("Kettle"), "push-flip")
    message = assert_retryable_checksum_failure(response, str(d.cluster.member("prefill").engine_id), "proxy",
                                                units="1")
    print(f"\n[flip_after_seal, push, verify full, fail] HTTP 502 kv_load_failed: {message}")
    assert_clean(d.cluster)
