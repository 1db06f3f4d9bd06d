"""SmolLM2 through P -> proxy -> D, real processes: same greedy answers as colocated, only missing
blocks move, the openai client works, bad requests get a 4xx that says why and leak nothing."""

from __future__ import annotations

import json
import math
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_helpers import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    assert_clean,
    cluster_for,
    complete,
    completion_text,
    spec,
)
from forge import resigned
from vllm_client import wait_metric

from kvlink.bench.cluster import Cluster
from kvlink.bench.instance_state import metric
from kvlink.cli.demo_cmd import PASSAGE
from kvlink.procs.launcher import free_port

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

MODEL = "smollm2-135m"
VOCAB = 49152
PROMPTS = ("The capital of France is", f"{PASSAGE}\n\nIn one sentence, the story is about")


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from cluster_for(spec(MODEL), tmp_path_factory, "smollm-1-1")


@pytest.fixture(scope="module")
def smollm_p3_d1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from cluster_for(spec(MODEL, p_tp=3, d_tp=1, colocated=False), tmp_path_factory, "smollm-3-1")


@pytest.fixture(scope="module")
def smollm_push(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from cluster_for(spec(MODEL, colocated=False, transfer_mode="push"), tmp_path_factory, "smollm-push")


def urls(cluster: Cluster) -> tuple[str, str, str]:
    assert cluster.proxy and cluster.decode and cluster.prefill
    return cluster.proxy.url, cluster.decode.url, cluster.prefill.url


def colocated_url(cluster: Cluster) -> str:
    assert cluster.colocated is not None
    return cluster.colocated.url


def bytes_per_block() -> int:
    """One logical block of every layer on a TP-1 worker, from the layout (not from a transfer)."""
    from kvlink.engine.model import load_config, smollm2_gguf_path
    from kvlink.engine.model.base import llama_spec
    from kvlink.layout.tensors import kv_tensor_specs

    model = llama_spec(load_config(smollm2_gguf_path()))
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[model.dtype]
    tensors = kv_tensor_specs(model, 1, BLOCK_SIZE, BLOCK_SIZE, NUM_BLOCKS)
    return sum(math.prod(t.shape) * item for t in tensors) // NUM_BLOCKS


def test_greedy_pd_equals_colocated_with_ttft_figures(smollm: Cluster) -> None:
    proxy, _, _ = urls(smollm)
    for prompt in PROMPTS:
        want, _ = completion_text(colocated_url(smollm), prompt, 12)
        got, body = completion_text(proxy, prompt, 12)
        assert got == want != ""
        figures = body["kvlink"]
        blocks = math.ceil((body["usage"]["prompt_tokens"] - 1) / BLOCK_SIZE)
        assert figures["role"] == "decode"
        assert 0 < figures["kv_bytes"] <= blocks * bytes_per_block()
        assert 0 <= figures["kv_transfer_s"] <= figures["ttft_s"]
        assert figures["prefill_s"] > 0
    chat = {"messages": [{"role": "user", "content": "Name a large city in Japan."}],
            "max_tokens": 10, "temperature": 0}
    answers = [httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()
               for url in (proxy, colocated_url(smollm))]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert "kvlink" not in answers[1]
    assert_clean(smollm)


def test_shared_prefix_moves_only_the_missing_blocks(smollm: Cluster) -> None:
    proxy, decode, _ = urls(smollm)
    rng = random.Random(7)
    first = [rng.randrange(100, VOCAB) for _ in range(100)]
    shared = 4 * BLOCK_SIZE
    second = first[:shared] + [rng.randrange(100, VOCAB) for _ in range(26)]
    per_block = bytes_per_block()

    _, body = completion_text(proxy, first, 2)
    assert body["kvlink"]["kv_bytes"] == math.ceil((len(first) - 1) / BLOCK_SIZE) * per_block

    before = kv_bytes_total(decode)
    _, body = completion_text(proxy, second, 2)
    # D holds the first 4 blocks from the first request; tokens [64, 89) are missing: 2 blocks.
    missing_blocks = math.ceil((len(second) - 1) / BLOCK_SIZE) - shared // BLOCK_SIZE
    assert missing_blocks == 2
    assert body["kvlink"]["kv_bytes"] == missing_blocks * per_block
    assert kv_bytes_total(decode) - before == missing_blocks * per_block
    want, _ = completion_text(colocated_url(smollm), second, 2)
    assert body["choices"][0]["text"] == want
    assert_clean(smollm)


def kv_bytes_total(url: str) -> int:
    return int(metric(url, "kvlink_server_kv_bytes_total"))


def test_push_mode_through_the_proxy_equals_colocated(smollm: Cluster, smollm_push: Cluster) -> None:
    """`--transfer-mode push`: P WRITEs the prompt's KV into the blocks D announced; the answers
    are the colocated ones, P's connector counts the bytes D reports, a shared prefix on D
    means only the missing blocks are pushed, and every pool is whole afterwards."""
    proxy, decode, prefill = urls(smollm_push)
    per_block = bytes_per_block()
    for prompt in PROMPTS:
        want, _ = completion_text(colocated_url(smollm), prompt, 10)
        pushed_before, read_before = metric(prefill, "kvlink_bytes_total"), metric(decode, "kvlink_bytes_total")
        got, body = completion_text(proxy, prompt, 10)
        assert got == want != ""
        blocks = math.ceil((body["usage"]["prompt_tokens"] - 1) / BLOCK_SIZE)
        assert body["kvlink"]["kv_bytes"] == blocks * per_block
        assert metric(prefill, "kvlink_bytes_total") - pushed_before == blocks * per_block  # P wrote them
        assert metric(decode, "kvlink_bytes_total") == read_before  # D read nothing
    rng = random.Random(11)
    first = [rng.randrange(100, VOCAB) for _ in range(80)]
    second = first[: 3 * BLOCK_SIZE] + [rng.randrange(100, VOCAB) for _ in range(20)]
    completion_text(proxy, first, 2)
    got, body = completion_text(proxy, second, 2)
    assert body["kvlink"]["kv_bytes"] == (math.ceil((len(second) - 1) / BLOCK_SIZE) - 3) * per_block
    want, _ = completion_text(colocated_url(smollm), second, 2)
    assert got == want
    assert_clean(smollm_push)


LAYERWISE = {"kv_transfer_params": {"transfer_mode": "layerwise"}}


def test_layerwise_through_the_proxy_equals_colocated(smollm: Cluster) -> None:
    """A request asking for `layerwise`: the proxy sends it to D and P at once, D asks P, P
    WRITEs each layer into D's blocks during its forward. Answers are the colocated ones
    (streamed too), P wrote the bytes D reports and D read none, a D prefix hit means only
    the missing blocks move, and every pool is whole afterwards."""
    proxy, decode, prefill = urls(smollm)
    per_block = bytes_per_block()
    rng = random.Random(13)  # prompts no other test sent: D's prefix cache holds none of them
    fresh: list[str | list[int]] = ["Layer by layer, the capital of Italy is",
                                    [rng.randrange(100, VOCAB) for _ in range(150)]]
    for prompt in fresh:
        want, _ = completion_text(colocated_url(smollm), prompt, 10)
        wrote, read = metric(prefill, "kvlink_bytes_total"), metric(decode, "kvlink_bytes_total")
        response = complete(proxy, prompt, 10, **LAYERWISE)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == want != ""
        blocks = math.ceil((body["usage"]["prompt_tokens"] - 1) / BLOCK_SIZE)
        assert body["kvlink"]["kv_bytes"] == blocks * per_block
        assert metric(prefill, "kvlink_bytes_total") - wrote == blocks * per_block
        assert metric(decode, "kvlink_bytes_total") == read
    streamed = complete(proxy, "Streamed layer by layer: name three colors.", 10, stream=True, **LAYERWISE)
    assert streamed.status_code == 200
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
                   if line.startswith("data: {"))
    assert text == completion_text(colocated_url(smollm), "Streamed layer by layer: name three colors.", 10)[0]
    first = [rng.randrange(100, VOCAB) for _ in range(70)]
    second = first[: 3 * BLOCK_SIZE] + [rng.randrange(100, VOCAB) for _ in range(30)]
    assert complete(proxy, first, 2, **LAYERWISE).status_code == 200
    response = complete(proxy, second, 2, **LAYERWISE)
    body = response.json()
    assert body["kvlink"]["kv_bytes"] == (math.ceil((len(second) - 1) / BLOCK_SIZE) - 3) * per_block
    assert body["choices"][0]["text"] == completion_text(colocated_url(smollm), second, 2)[0]
    assert metric(prefill, "kvlink_refused_push_requests_total") == 0
    assert_clean(smollm)


def test_client_leaving_a_layerwise_request_frees_d_once_p_stopped(smollm: Cluster) -> None:
    """The client leaves a layerwise request while P (frozen) has not prefilled it: the proxy
    drops both legs and D aborts the request, but keeps its blocks while P could still write
    into them. D asks P to stop; once P runs again and answers, D frees them, long before
    its layerwise deadline (60 s). P frees too, nothing leaks, and the next request is exact."""
    proxy, decode, prefill = urls(smollm)
    assert complete(proxy, "Warm, layer by layer:", 2, **LAYERWISE).status_code == 200  # P knows D
    prompt = "(client leaves) " + PROMPTS[1]
    want = completion_text(colocated_url(smollm), prompt, 10)[0]
    cancelled = metric(decode, "kvlink_cancelled_loads_total")
    smollm.signal("prefill", signal.SIGSTOP)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{proxy}/v1/completions", timeout=2.0, json={
                "prompt": prompt, "max_tokens": 10, "temperature": 0, **LAYERWISE})
        deadline = time.monotonic() + 10
        while metric(decode, "kvlink_cancelled_loads_total") == cancelled:
            assert time.monotonic() < deadline, "D never asked P to stop"
            time.sleep(0.1)
        time.sleep(1.0)
        engine = smollm.state("decode")["engine"]
        assert engine["held_requests"] == 1, "D gave its blocks back while P could still write them"
    finally:
        smollm.signal("prefill", signal.SIGCONT)
    resumed = time.monotonic()
    assert_clean(smollm, timeout_s=20)
    print(f"[client left, layerwise] instances clean {time.monotonic() - resumed:.1f} s after P resumed")
    # P counts the cancel when it reads D's message; the count reaches its /metrics with the
    # next figures refresh (at most 0.5 s later while idle: connector/tap.py), which may come
    # after both sides are clean when P had already dropped the aborted request.
    assert wait_metric(prefill, "kvlink_cancelled_pushes_total", above=0, within_s=5) >= 1
    response = complete(proxy, prompt, 10, **LAYERWISE)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == want


def test_openai_client_through_the_proxy(smollm: Cluster) -> None:
    proxy, _, _ = urls(smollm)
    clients = [openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
               for url in (proxy, colocated_url(smollm))]
    messages = [{"role": "user", "content": "What is the capital of Italy?"}]
    whole = [c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
             for c in clients]
    assert whole[0].choices[0].message.content == whole[1].choices[0].message.content
    assert whole[0].usage is not None and whole[0].usage.completion_tokens >= 1
    stream = clients[0].chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole[1].choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole[1].choices[0].finish_reason
    text = clients[0].completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                         temperature=0).choices[0].text
    assert text == clients[1].completions.create(model=MODEL, prompt="Once upon a time",
                                                 max_tokens=6, temperature=0).choices[0].text
    # vLLM's extensions reach D through the proxy (P gets at most one min_token) as colocated
    extensions = [{"min_tokens": 12}, {"ignore_eos": True}, {"stop_token_ids": [30], "min_tokens": 2}]
    for extra, at_least in zip(extensions, (12, 16, 2), strict=True):
        answers = [c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                             extra_body=extra) for c in clients]
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content, extra
        assert answers[0].usage is not None and answers[1].usage is not None
        assert answers[0].usage.completion_tokens == answers[1].usage.completion_tokens >= at_least, extra
    with httpx.stream("POST", f"{proxy}/v1/completions", timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 3, "stream": True}) as raw:
        assert float(raw.headers["x-kvlink-prefill-s"]) > 0
        events = [json.loads(line[6:]) for line in raw.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["kvlink"]["kv_bytes"] > 0
    assert_clean(smollm)


def test_bad_requests_get_4xx_saying_why_and_leak_nothing(smollm: Cluster) -> None:
    proxy, decode, _ = urls(smollm)
    prefill = smollm.member("prefill")
    engine_id, kv_port = prefill.engine_id, prefill.kv_port
    unsigned = {"do_remote_prefill": True, "remote_engine_id": engine_id, "remote_request_id": "gone",
                "remote_block_ids": [[1]], "remote_host": "127.0.0.1", "remote_port": kv_port,
                "tp_size": 1}
    remote = resigned(unsigned, smollm.secret)  # the test plays P, so D's load path is reached
    too_long = [100] * (NUM_BLOCKS * BLOCK_SIZE + 10)
    cases: list[tuple[str, str, dict[str, object], str]] = [
        ("direct to D: params missing a field", decode,
         {"kv_transfer_params": {"do_remote_prefill": True}}, "remote_engine_id"),
        ("direct to D: params not an object", decode, {"kv_transfer_params": "x"}, "kv_transfer_params"),
        ("direct to D: unsigned params", decode, {"kv_transfer_params": unsigned}, "no kv_signature"),
        ("direct to D: bad port", decode,
         {"kv_transfer_params": {**remote, "remote_port": 70000}}, "not a TCP port"),
        ("direct to D: unknown remote engine", decode,
         {"kv_transfer_params": resigned(remote, smollm.secret, remote_engine_id="nope")}, "not 'nope'"),
        ("direct to D: block ids out of range", decode,
         {"kv_transfer_params": resigned(remote, smollm.secret, remote_block_ids=[[NUM_BLOCKS + 5]])},
         f"[0, {NUM_BLOCKS})"),
        ("direct to D: prompt longer than the context", decode,
         {"prompt": too_long, "kv_transfer_params": remote}, "maximum context length"),
        ("proxy: prompt longer than the context", proxy, {"prompt": too_long}, "maximum context length"),
        ("direct to D: max_tokens past the context", decode,
         {"max_tokens": 10_000, "kv_transfer_params": remote}, "reduce max_tokens"),
        # P prefills before D refuses: D must tell P to free now (assert_clean below waits less
        # than the lease)
        ("proxy: max_tokens past the context", proxy, {"max_tokens": 10_000}, "reduce max_tokens"),
        # fields P's leg rewrites: the proxy refuses them before P prefills for nothing
        ("proxy: negative max_tokens", proxy, {"max_tokens": -1}, "max_tokens"),
        ("proxy: fractional max_tokens", proxy, {"max_tokens": 2.5}, "max_tokens"),
        ("proxy: stream_options not an object", proxy, {"stream": True, "stream_options": "x"}, "stream_options"),
        ("direct to D: prompt far over the context, refused untokenized", decode,
         {"prompt": "word " * 400_000}, "maximum context length"),
        ("proxy: bad temperature", proxy, {"temperature": 7}, "temperature"),
        ("proxy: streaming, prompt too long", proxy, {"prompt": too_long, "stream": True},
         "maximum context length"),
    ]
    for name, url, overrides, needle in cases:
        body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, **overrides}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert 400 <= response.status_code < 500, f"{name}: HTTP {response.status_code} {response.text}"
        message = response.json()["error"]["message"]
        assert needle in message, f"{name}: {message!r} does not mention {needle!r}"
    response = httpx.post(f"{proxy}/v1/completions", content=b"{not json", timeout=10)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    # Params naming a P nobody listens for (P died after answering) are not the client's fault:
    # a retryable 502, not a 4xx.
    unreachable = resigned(remote, smollm.secret, remote_engine_id="elsewhere", remote_port=free_port())
    response = httpx.post(f"{decode}/v1/completions", timeout=60, json={
        "prompt": "Hello there", "max_tokens": 3, "temperature": 0, "kv_transfer_params": unreachable})
    error = response.json()["error"]
    assert response.status_code == 502 and error["code"] == "kv_load_failed", response.text
    assert "Connection refused" in error["message"]
    assert_clean(smollm)
    # D still serves after refusing all of that.
    assert complete(proxy, "The capital of France is", 2).status_code == 200
    assert_clean(smollm)


def test_tiny_temperature_or_top_p_answers_greedily_and_keeps_the_engines(smollm: Cluster) -> None:
    """A temperature or top_p above 0 but below what float32 holds used to turn D's sampling
    into NaN, which stopped its engine for every later request (503 until restarted)."""
    proxy, decode, _ = urls(smollm)
    prompt = PROMPTS[0]
    greedy = completion_text(colocated_url(smollm), prompt, 6)[0]
    for extra in ({"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1.0, "top_p": 1e-300}):
        for url in (proxy, colocated_url(smollm)):
            response = httpx.post(f"{url}/v1/completions", timeout=60,
                                  json={"prompt": prompt, "max_tokens": 6, "seed": 3, **extra})
            assert response.status_code == 200, f"{url} {extra}: {response.text}"
            assert response.json()["choices"][0]["text"] == greedy, extra
    for url in (decode, colocated_url(smollm)):
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert_clean(smollm)


def test_client_leaving_while_p_prefills_frees_p_before_its_lease(smollm: Cluster) -> None:
    """The client leaves while P computes a long prefill: P's request finishes in the step
    that is running, but its params never reach anyone, so P must free the blocks now, not
    when its lease (30 s) runs out."""
    proxy, _, _ = urls(smollm)
    for leave_after_s in (0.05, 0.15):
        # ~930 new tokens (nothing cached: the prompt starts differently each time) take P
        # about a second here, and several under load
        long_prompt = f"({leave_after_s} s, then the client leaves) " + (PASSAGE + "\n") * 3
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{proxy}/v1/completions", timeout=leave_after_s,
                       json={"prompt": long_prompt, "max_tokens": 4, "temperature": 0})
    started = time.monotonic()
    assert_clean(smollm, timeout_s=15)  # well inside the lease
    print(f"[client left during P's prefill] clean {time.monotonic() - started:.1f} s later")
    assert complete(proxy, PROMPTS[0], 2).status_code == 200


def test_the_secret_is_on_no_command_line(smollm_p3_d1: Cluster) -> None:
    """P's TP followers get the secret in their environment: every local user can read argv."""
    assert smollm_p3_d1.prefill is not None
    followers, showing = 0, []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes()
            session = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        followers += session == smollm_p3_d1.prefill.proc.pid and b"kvlink.engine.tp_worker" in argv
        if smollm_p3_d1.secret.encode() in argv:
            showing.append(argv.replace(b"\0", b" ")[:120])
    assert followers == 2, "expected P's two TP follower processes"
    assert not showing, showing


def test_heterogeneous_tp_p3_d1_equals_colocated(smollm: Cluster, smollm_p3_d1: Cluster) -> None:
    proxy, _, _ = urls(smollm_p3_d1)
    for prompt in PROMPTS:
        want, _ = completion_text(colocated_url(smollm), prompt, 8)
        got, body = completion_text(proxy, prompt, 8)
        assert got == want != ""
        assert body["kvlink"]["kv_bytes"] > 0
    assert_clean(smollm_p3_d1)
