"""The P/D proxy against real HTTP upstreams (our app over fake engines, and misbehaving apps)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from serve_fakes import FakeEngine, FakeSampling, FakeTokenizer, serve_in_thread

from kvlink.procs.launcher import free_port
from kvlink.serve.api_server import build_app
from kvlink.serve.engine_loop import AsyncEngine
from kvlink.serve.metrics import MetricsRegistry
from kvlink.serve.proxy import build_proxy_app
from kvlink.serve.upstream import InstancePool


@contextmanager
def fake_instance(role: str, engine: FakeEngine) -> Iterator[str]:
    async_engine = AsyncEngine(engine, request_timeout_s=5.0, idle_wait_s=0.01)
    async_engine.start()
    app = build_app(async_engine, FakeTokenizer(), "fake-model", role, MetricsRegistry("s"),
                    max_model_len=64, sampling_factory=FakeSampling)
    try:
        with serve_in_thread(app) as url:
            yield url
    finally:
        async_engine.shutdown()


def misbehaving_app(status: int | None, code: str | None = None,
                    headers: dict[str, str] | None = None) -> FastAPI:
    """Answers every completion with `status` (and error `code`, `headers`), or never
    answers when `status` is None."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        if status is None:
            await asyncio.sleep(3600)
        return JSONResponse({"error": {"message": "simulated upstream failure", "code": code}},
                            status_code=status, headers=headers)

    return app


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def pd() -> Iterator[tuple[str, FakeEngine, FakeEngine]]:
    """A proxy URL in front of one fake P and one fake D."""
    p_engine, d_engine = FakeEngine(), FakeEngine()
    with ExitStack() as stack:
        p_url = stack.enter_context(fake_instance("prefill", p_engine))
        d_url = stack.enter_context(fake_instance("decode", d_engine))
        proxy = build_proxy_app([p_url], [d_url], timeout_s=5.0)
        yield stack.enter_context(serve_in_thread(proxy)), p_engine, d_engine


def p_engine_url(proxy_url: str) -> str:
    """The prefill instance behind a proxy (its /health names it)."""
    return str(httpx.get(f"{proxy_url}/health", timeout=5).json()["prefill"][0]["url"])


def test_prefill_params_are_forwarded_to_decode(pd: tuple[str, FakeEngine, FakeEngine]) -> None:
    proxy_url, p_engine, d_engine = pd
    request = {"prompt": "hello", "max_tokens": 5}
    body = httpx.post(f"{proxy_url}/v1/completions", json=request, timeout=10).json()
    assert body["choices"][0]["text"] == "abcde"
    [(p_prompt, p_sampling, p_params)] = p_engine.seen.values()
    [(d_prompt, d_sampling, d_params)] = d_engine.seen.values()
    assert p_params == {"do_remote_decode": True} and p_sampling.max_tokens == 1
    assert d_params is not None and d_params["remote_engine_id"] == "fake-p"
    assert d_params["remote_request_id"] in p_engine.seen
    assert d_prompt == p_prompt and d_sampling.max_tokens == 5
    assert httpx.get(f"{proxy_url}/v1/models").json()["data"][0]["role"] == "decode"
    metrics = httpx.get(f"{proxy_url}/metrics").text
    assert "kvlink_proxy_prefill_seconds_count 1" in metrics
    assert 'kvlink_proxy_requests_total{outcome="ok"} 1' in metrics
    # one metric, one TYPE line: both pools' upstreams under it (promtool refuses a second)
    assert metrics.count("# TYPE kvlink_proxy_upstream_in_flight gauge") == 1
    assert metrics.count("kvlink_proxy_upstream_in_flight{") == 2


def test_stream_is_passed_through_from_decode(pd: tuple[str, FakeEngine, FakeEngine]) -> None:
    proxy_url, _, _ = pd
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    response = httpx.post(f"{proxy_url}/v1/chat/completions", json=request, timeout=10)
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(item) for item in data[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "abcd"


def test_one_log_line_per_request_with_its_outcome(pd: tuple[str, FakeEngine, FakeEngine],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    proxy_url, _, _ = pd
    caplog.set_level(logging.INFO, logger="kvlink.proxy")
    ok = httpx.post(f"{proxy_url}/v1/completions", json={"prompt": "hello", "max_tokens": 3},
                    headers={"X-Request-Id": "req-ok"}, timeout=10)
    streamed = httpx.post(f"{proxy_url}/v1/completions", headers={"X-Request-Id": "req-stream"},
                          json={"prompt": "hello", "max_tokens": 3, "stream": True}, timeout=10)
    bad = httpx.post(f"{proxy_url}/v1/completions", json={"prompt": "hello", "model": "another"},
                     headers={"X-Request-Id": "req-bad"}, timeout=10)
    assert (ok.status_code, streamed.status_code, bad.status_code) == (200, 200, 404)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(caplog.records) < 3:
        time.sleep(0.02)  # the stream's line comes when its body is done
    lines = {r.getMessage().split()[1]: r.getMessage() for r in caplog.records if r.name == "kvlink.proxy"}
    assert set(lines) == {"req-ok", "req-stream", "req-bad"}, lines
    assert re.search(r"prefill=[\d.]+ms decode=http://127\.0\.0\.1:\d+ total=[\d.]+ms outcome=ok$",
                     lines["req-ok"]), lines["req-ok"]
    assert lines["req-stream"].endswith("outcome=ok") and "decode=http://" in lines["req-stream"]
    assert "prefill=- decode=- " in lines["req-bad"] and "outcome=model_not_found (" in lines["req-bad"]


def test_client_disconnect_mid_stream_aborts_on_decode(pd: tuple[str, FakeEngine, FakeEngine]) -> None:
    proxy_url, _, d_engine = pd
    request = {"prompt": "slow", "max_tokens": 60, "stream": True}
    with httpx.stream("POST", f"{proxy_url}/v1/completions", json=request, timeout=10) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 5
    while not d_engine.aborted:
        assert time.monotonic() < deadline, "decode instance never saw the abort"
        time.sleep(0.05)
    assert not d_engine.running
    # counted once, as the 499 the client would have had (it was counted as nothing before)
    while 'kvlink_proxy_requests_total{outcome="client_closed"} 1' not in httpx.get(f"{proxy_url}/metrics").text:
        assert time.monotonic() < deadline, httpx.get(f"{proxy_url}/metrics").text
        time.sleep(0.05)
    assert 'outcome="ok"' not in httpx.get(f"{proxy_url}/metrics").text


@pytest.mark.parametrize(
    ("side", "status", "expected_status", "expected"),
    [
        ("prefill", 0, 502, "prefill instance {url} is unreachable"),
        ("prefill", 400, 400, "prefill instance {url} refused the request (HTTP 400)"),
        ("decode", 500, 502, "decode instance {url} failed (HTTP 500): simulated upstream failure"),
        ("decode", None, 504, "decode instance {url} did not answer within 1s"),
        ("prefill", None, 504, "prefill instance {url} did not answer within 1s"),
    ],
)
def test_upstream_failures_become_clear_http_errors(
    side: str, status: int | None, expected_status: int, expected: str
) -> None:
    good = FakeEngine()
    with ExitStack() as stack:
        good_url = stack.enter_context(fake_instance("prefill" if side == "decode" else "decode", good))
        bad_url = closed_port_url() if status == 0 else stack.enter_context(
            serve_in_thread(misbehaving_app(status)))
        urls = (bad_url, good_url) if side == "prefill" else (good_url, bad_url)
        proxy = stack.enter_context(serve_in_thread(build_proxy_app([urls[0]], [urls[1]], timeout_s=1.0)))
        started = time.monotonic()
        response = httpx.post(f"{proxy}/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert time.monotonic() - started < 5
    assert response.status_code == expected_status
    assert expected.format(url=bad_url) in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("side", "status", "code", "headers", "expected_status", "expected_code", "retry_after"),
    [
        # The client's request is at fault: status and code pass through.
        ("prefill", 404, "model_not_found", None, 404, "model_not_found", None),
        ("prefill", 400, "context_length_exceeded", None, 400, "context_length_exceeded", None),
        # D refuses the params P made: not the client's fault, retryable.
        ("decode", 400, "invalid_kv_transfer_params", None, 502, "decode_kv_load_failed", None),
        ("decode", 403, "forbidden_kv_transfer_params", None, 502, "decode_kv_load_failed", None),
        # D could not load the KV (P dead) or waited past its stall deadline.
        ("decode", 502, "kv_load_failed", None, 502, "kv_load_failed", None),
        ("decode", 504, "kv_load_timeout", None, 504, "kv_load_timeout", None),
        # An instance busy or dead: 503 with its Retry-After (1 s when it gave none).
        ("prefill", 503, "engine_dead", {"Retry-After": "5"}, 503, "engine_dead", "5"),
        ("decode", 503, None, None, 503, "decode_unavailable", "1"),
        ("decode", 503, None, {"Retry-After": "\u00b2"}, 503, "decode_unavailable", "1"),
        ("decode", 500, "internal_error", None, 502, "decode_failed", None),
        # A code that is not one of ours is not passed on (it would become a metric label).
        ("prefill", 400, 'x"} 1\nevil', None, 400, "prefill_refused", None),
    ],
)
def test_upstream_statuses_are_passed_on_or_translated(
    side: str, status: int, code: str | None, headers: dict[str, str] | None, expected_status: int,
    expected_code: str, retry_after: str | None,
) -> None:
    good = FakeEngine()
    with ExitStack() as stack:
        good_url = stack.enter_context(fake_instance("prefill" if side == "decode" else "decode", good))
        bad_url = stack.enter_context(serve_in_thread(misbehaving_app(status, code, headers)))
        urls = (bad_url, good_url) if side == "prefill" else (good_url, bad_url)
        proxy = stack.enter_context(serve_in_thread(build_proxy_app([urls[0]], [urls[1]], timeout_s=5.0)))
        response = httpx.post(f"{proxy}/v1/completions", json={"prompt": "hi"}, timeout=10)
        metrics = httpx.get(f"{proxy}/metrics", timeout=5).text
    assert response.status_code == expected_status
    error = response.json()["error"]
    assert error["code"] == expected_code and bad_url in error["message"], error
    assert response.headers.get("retry-after") == retry_after
    assert f'kvlink_proxy_requests_total{{outcome="{expected_code}"}} 1' in metrics
    assert "kvlink_proxy_total_seconds_count 1" in metrics  # a failed request is timed too


@pytest.mark.parametrize(("p_role", "d_role", "failed_side"), [("decode", "decode", "prefill"),
                                                              ("both", "decode", "prefill"),
                                                              ("prefill", "both", "decode")])
def test_an_upstream_of_the_wrong_role_is_a_502_naming_the_role_not_the_clients_400(
        p_role: str, d_role: str, failed_side: str) -> None:
    """The params an upstream refuses are the ones the proxy wrote: a proxy pointed at an
    instance of the wrong role answers 502 `<side>_failed` naming the role it needs (a 400
    on `kv_transfer_params` would blame the client, who sent none). A colocated instance
    given P's params refuses them instead of prefilling unseen while P holds the blocks."""
    p_engine, d_engine = FakeEngine(colocated=p_role == "both"), FakeEngine(colocated=d_role == "both")
    with ExitStack() as stack:
        p_url = stack.enter_context(fake_instance(p_role, p_engine))
        d_url = stack.enter_context(fake_instance(d_role, d_engine))
        proxy = stack.enter_context(serve_in_thread(build_proxy_app([p_url], [d_url], timeout_s=5.0)))
        response = httpx.post(f"{proxy}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == f"{failed_side}_failed" and f"--role {failed_side}" in error["message"], error
    # nothing ran on D: at most a refused request entered and aborted at once to free P's blocks
    assert all(rid.startswith("refused-") and rid in d_engine.aborted for rid in d_engine.seen), d_engine


def test_unknown_model_through_the_proxy_is_404_from_p(pd: tuple[str, FakeEngine, FakeEngine]) -> None:
    proxy_url, p_engine, d_engine = pd
    response = httpx.post(f"{proxy_url}/v1/completions", timeout=10,
                          json={"prompt": "hi", "model": "gpt-4o"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model",
                                                              "invalid_request_error")
    assert not p_engine.seen and not d_engine.seen


def test_pool_picks_least_loaded_and_rotates_ties() -> None:
    pool = InstancePool.of("decode", ["http://a", "http://b", "http://c"])
    busy = pool.take()
    picks = {pool.take().url for _ in range(2)}
    assert busy.url not in picks and len(picks) == 2
    assert [i.in_flight for i in pool.instances] == [1, 1, 1]
    with pytest.raises(ValueError, match="at least one prefill"):
        InstancePool.of("prefill", [])


def test_non_json_body_is_a_400() -> None:
    proxy = build_proxy_app(["http://p"], ["http://d"])
    with serve_in_thread(proxy) as url:
        response = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=5)
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize(("body", "named"), [(b'{"prompt": "x", "temperature": NaN}', "NaN"),
                                             (b'{"prompt": "x", "top_p": -Infinity}', "-Infinity"),
                                             (b'{"prompt": "x", "temperature": 1e400}', "1e400")])
def test_numbers_json_cannot_carry_are_a_400(body: bytes, named: str) -> None:
    """Python's JSON reads NaN, Infinity and overflowing floats, but the proxy could not forward
    them: refused as the client's bad JSON, not blamed on P (P is never called here)."""
    proxy = build_proxy_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    with serve_in_thread(proxy) as url:
        response = httpx.post(f"{url}/v1/completions", content=body, timeout=5,
                              headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_json" and named in error["message"], error




def test_proxy_cli_serves_health_and_stops_on_sigterm() -> None:
    port = free_port()
    command = [sys.executable, "-m", "kvlink.cli.main", "proxy", "--prefill", "http://127.0.0.1:1",
               "--decode", "http://127.0.0.1:2", "http://127.0.0.1:3", "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "proxy did not start"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert [i["url"] for i in health["decode"]] == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
            pytest.fail("the proxy ignored SIGTERM for 10s")


def test_p_gets_the_mode_a_client_asks_for() -> None:
    """pull / push from the client's kv_transfer_params reach P (its default otherwise);
    layerwise tells P which key D will ask by."""
    from kvlink.serve.proxy import layerwise_prefill_body, prefill_body, wants_layerwise

    body = {"prompt": "x", "max_tokens": 9, "stream": True, "kv_transfer_params": {"transfer_mode": "push"}}
    assert prefill_body(body)["kv_transfer_params"] == {"do_remote_decode": True, "transfer_mode": "push"}
    assert prefill_body({"prompt": "x"})["kv_transfer_params"] == {"do_remote_decode": True}
    assert layerwise_prefill_body(body, "k1")["kv_transfer_params"] == {
        "do_remote_decode": True, "transfer_mode": "layerwise", "layerwise_id": "k1"}
    assert wants_layerwise({"kv_transfer_params": {"transfer_mode": "layerwise"}}, "classic")
    assert wants_layerwise({}, "layerwise") and not wants_layerwise(body, "layerwise")


def test_p_gets_at_most_one_min_token() -> None:
    """P answers one token: a client's `min_tokens` (for D's answer) goes to P as 1 at most."""
    from kvlink.serve.proxy import prefill_body

    for asked, sent in ((5, 1), (1, 1), (0, 0), (-2, -2), ("3", "3"), (None, None)):
        body = {"prompt": "x", "max_tokens": 9, "min_tokens": asked}
        assert prefill_body(body)["min_tokens"] == sent and body["min_tokens"] == asked
    assert "min_tokens" not in prefill_body({"prompt": "x"})


@pytest.mark.parametrize(("field", "value"), [("max_tokens", -1), ("max_tokens", 2.5), ("max_tokens", "many"),
                                              ("max_completion_tokens", 0), ("min_tokens", -3),
                                              ("stream", "x"), ("stream_options", "x"),
                                              ("kv_transfer_params", "str"),
                                              ("kv_transfer_params", {"transfer_mode": "layerwize"})])
def test_fields_p_would_not_see_are_checked_before_p_prefills(
        pd: tuple[str, FakeEngine, FakeEngine], field: str, value: object) -> None:
    """P's leg rewrites these fields, so a bad value would only reach D, after P prefilled
    and while P holds the blocks under a lease: the proxy refuses it first."""
    proxy_url, p_engine, d_engine = pd
    response = httpx.post(f"{proxy_url}/v1/completions", json={"prompt": "hello", field: value}, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error
    assert not p_engine.seen and not d_engine.seen
    fine = httpx.post(f"{proxy_url}/v1/completions", json={"prompt": "hello", "max_tokens": "2"}, timeout=10)
    assert fine.status_code == 200, fine.text  # what an instance coerces, the proxy lets through


@pytest.mark.parametrize("extra", [{"stream": None}, {"stream": "false"}, {"min_tokens": "2", "max_tokens": "3"},
                                   {"stream": True, "stream_options": {"include_usage": None, "other": 1}}])
def test_values_an_instance_coerces_reach_d_as_it_reads_them(
        pd: tuple[str, FakeEngine, FakeEngine], extra: dict[str, object]) -> None:
    """What P accepts D must accept too: the proxy passes the rewritten fields on as an instance
    reads them (null stream as false, "false" as false, "2" as 2), so D does not refuse what
    P prefilled, and a "false" stream is answered as JSON, not as an event stream."""
    proxy_url, p_engine, d_engine = pd
    response = httpx.post(f"{proxy_url}/v1/completions", json={"prompt": "hello", **extra}, timeout=10)
    assert response.status_code == 200, response.text
    assert len(p_engine.seen) == len(d_engine.seen) == 1
    streamed = extra.get("stream") is True
    assert response.headers["content-type"].startswith("text/event-stream" if streamed else "application/json")
    if "min_tokens" in extra:
        [(_, d_sampling, _)] = d_engine.seen.values()
        assert d_sampling.min_tokens == 2 and d_sampling.max_tokens == 3


def test_text_no_utf8_can_carry_is_the_clients_400_not_ps_502(pd: tuple[str, FakeEngine, FakeEngine]) -> None:
    """A lone surrogate (a JSON \\u escape) goes on to P as JSON and P refuses it; a request id
    HTTP cannot carry is refused by the proxy. Neither is blamed on P as a 502."""
    proxy_url, p_engine, _ = pd
    for route, body in (("/v1/completions", b'{"prompt": "\\ud800 hi", "max_tokens": 2}'),
                        ("/v1/chat/completions",
                         b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}')):
        response = httpx.post(f"{proxy_url}{route}", content=body, timeout=10,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert "lone surrogate" in response.json()["error"]["message"]
    response = httpx.post(f"{proxy_url}/v1/completions", json={"prompt": "hi"}, timeout=10,
                          headers={"x-request-id": "é-ü".encode()})
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-request-id", response.text
    assert not p_engine.seen


def test_deeply_nested_json_is_a_400() -> None:
    proxy = build_proxy_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    body = b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with serve_in_thread(proxy) as url:
        response = httpx.post(f"{url}/v1/completions", content=body, timeout=10,
                              headers={"content-type": "application/json"})
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"]


def test_bodies_over_the_cap_are_413_on_instances_and_the_proxy(pd: tuple[str, FakeEngine, FakeEngine]) -> None:
    from kvlink.serve.body_limit import MAX_BODY_BYTES

    proxy_url, p_engine, d_engine = pd
    big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap holds on the stream too
        for start in range(0, len(big), 1 << 20):
            yield big[start:start + (1 << 20)]

    p_url = p_engine_url(proxy_url)
    for url in (proxy_url, p_url):  # the proxy reads the body itself; an instance through FastAPI
        for content in (big, chunks()):
            response = httpx.post(f"{url}/v1/completions", content=content, timeout=30,
                                  headers={"content-type": "application/json"})
            assert response.status_code == 413, response.text[:300]
            assert response.json()["error"]["code"] == "request_too_large"
    assert not p_engine.seen and not d_engine.seen
    assert httpx.get(f"{p_url}/health", timeout=5).status_code == 200


def recording_prefill_app(handed_back: list[dict[str, object]], answered: threading.Event | None = None) -> FastAPI:
    """A prefill instance that answers every completion with params (and sets `answered`),
    and records the params a router hands back on `/v1/kv_release`."""
    app = FastAPI()
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "p-1",
              "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        if answered is not None:
            answered.set()
        return JSONResponse({"choices": [{"text": "x", "index": 0}], "kv_transfer_params": params})

    @app.post("/v1/kv_release")
    async def release(body: dict[str, object]) -> JSONResponse:
        handed_back.append(body)
        return JSONResponse({"released": True})

    @app.get("/v1/kv_endpoint")
    async def endpoint() -> JSONResponse:
        return JSONResponse({"remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1})

    return app


def slow_refusing_decode_app(delay_s: float, after: threading.Event | None = None) -> FastAPI:
    """A decode instance that refuses every request (400) after `delay_s`, or as soon as
    `after` is set."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        if after is not None:
            await asyncio.get_running_loop().run_in_executor(None, after.wait, 10)
        await asyncio.sleep(delay_s)
        return JSONResponse({"error": {"message": "min_tokens too large", "code": "invalid_value"}}, status_code=400)

    return app


@pytest.mark.parametrize("d_delay_s", [0.3, 0.0])
def test_a_layerwise_request_d_refuses_after_p_answered_hands_p_its_params_back(d_delay_s: float) -> None:
    """Layerwise: P and D legs run at once. If P has answered (its blocks held for D's push)
    when D refuses, or answers just as D refuses (its answer on the way: cancelling the call
    would drop it), the proxy hands P's params back."""
    handed_back: list[dict[str, object]] = []
    answered = threading.Event()
    with ExitStack() as stack:
        p_url = stack.enter_context(serve_in_thread(recording_prefill_app(handed_back, answered)))
        d_url = stack.enter_context(serve_in_thread(slow_refusing_decode_app(d_delay_s, answered)))
        proxy = stack.enter_context(serve_in_thread(build_proxy_app([p_url], [d_url], timeout_s=30.0, mode="layerwise")))
        response = httpx.post(f"{proxy}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert response.status_code == 400, response.text
        deadline = time.monotonic() + 5
        while not handed_back and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(handed_back) == 1
    assert handed_back[0]["kv_transfer_params"]["remote_request_id"] == "p-1"  # type: ignore[index]


def answering_decode_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        return JSONResponse({"choices": [{"text": "decoded", "index": 0, "finish_reason": "length"}]})

    return app


@pytest.mark.parametrize(("decode", "client_timeout_s", "hands_back"), [
    ("unreachable", 10.0, True),  # D never got the params
    ("failing", 10.0, True),  # D answered an error: its load is over
    ("silent", 0.5, False),  # the client left while D may be reading P's blocks: D's abort tells P
    ("answering", 10.0, False),  # D answered: its load read P's KV and told P
])
def test_params_d_is_done_with_go_back_to_p(decode: str, client_timeout_s: float, hands_back: bool) -> None:
    """When the decode leg ends with D unreachable or refusing, the proxy hands P's params
    back (`POST /v1/kv_release`) so P frees the blocks now instead of at the end of its
    lease; never while D may still read them."""
    handed_back: list[dict[str, object]] = []
    with ExitStack() as stack:
        p_url = stack.enter_context(serve_in_thread(recording_prefill_app(handed_back)))
        d_app = answering_decode_app() if decode == "answering" else misbehaving_app(None if decode == "silent" else 500)
        d_url = closed_port_url() if decode == "unreachable" else stack.enter_context(serve_in_thread(d_app))
        proxy = stack.enter_context(serve_in_thread(build_proxy_app([p_url], [d_url], timeout_s=30.0)))
        with pytest.raises(httpx.ReadTimeout) if decode == "silent" else contextlib.nullcontext():
            response = httpx.post(f"{proxy}/v1/completions", json={"prompt": "hi"}, timeout=client_timeout_s)
            assert response.status_code == (200 if decode == "answering" else 502)
        deadline = time.monotonic() + 5
        while hands_back and not handed_back and time.monotonic() < deadline:
            time.sleep(0.05)
        if not hands_back:
            time.sleep(0.5)
        metrics = httpx.get(f"{proxy}/metrics", timeout=5).text
    if hands_back:
        assert len(handed_back) == 1
        assert handed_back[0]["kv_transfer_params"]["remote_request_id"] == "p-1"  # type: ignore[index]
        assert 'kvlink_proxy_params_handed_back_total{outcome="released"} 1' in metrics
    else:
        assert not handed_back


@contextmanager
def restartable_p_behind_a_layerwise_proxy(late_first_answer_s: float = 0.0) -> Iterator[tuple[dict[str, Any], Any]]:
    """A fake P whose engine id is `state["engine"]` (a test sets another to restart it), a
    fake D that refuses params naming any other engine (as a handshake would), and a
    layerwise proxy before them. Yields (state, status): status() sends one request through
    the proxy. `late_first_answer_s`: P answers its first call that much later, naming the
    engine it began as."""
    state: dict[str, Any] = {"engine": "P-1", "calls": 0}
    app = FastAPI()

    @app.get("/v1/kv_endpoint")
    async def endpoint() -> JSONResponse:
        return JSONResponse({"remote_engine_id": state["engine"], "remote_host": "127.0.0.1", "remote_port": 1,
                             "tp_size": 1})

    @app.post("/v1/completions")
    async def prefill() -> JSONResponse:
        state["calls"] += 1
        engine = state["engine"]
        if state["calls"] == 1 and late_first_answer_s:
            await asyncio.sleep(late_first_answer_s)
        return JSONResponse({"choices": [{"text": "x", "index": 0}], "kv_transfer_params": {
            "do_remote_prefill": True, "remote_engine_id": engine, "remote_request_id": "r",
            "remote_block_ids": [[1]], "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}})

    decode = FastAPI()

    @decode.post("/v1/completions")
    async def decode_leg(body: dict[str, object]) -> JSONResponse:
        named = body["kv_transfer_params"]["remote_engine_id"]  # type: ignore[index]
        if named != state["engine"]:
            return JSONResponse({"error": {"message": f"handshake refused: this listener serves engine "
                                                      f"{state['engine']!r}, not {named!r}",
                                           "code": "invalid_kv_transfer_params"}}, status_code=400)
        return JSONResponse({"choices": [{"text": "decoded", "index": 0, "finish_reason": "length"}]})

    with ExitStack() as stack:
        p_url = stack.enter_context(serve_in_thread(app))
        d_url = stack.enter_context(serve_in_thread(decode))
        proxy = stack.enter_context(serve_in_thread(build_proxy_app([p_url], [d_url], timeout_s=30.0, mode="layerwise")))

        def status() -> int:
            return httpx.post(f"{proxy}/v1/completions", json={"prompt": "hi"}, timeout=10).status_code

        yield state, status


def test_a_layerwise_proxy_follows_a_restarted_p_after_one_failed_request() -> None:
    """The proxy keeps P's side channel from `/v1/kv_endpoint`. P restarted under a new
    engine id makes D refuse the handshake: that request fails (retryable), the proxy forgets
    the endpoint, asks P again and the next request goes through (it used to fail for good)."""
    with restartable_p_behind_a_layerwise_proxy() as (state, status):
        assert status() == 200
        state["engine"] = "P-2"  # P restarted
        assert status() == 502  # D refused the old engine id
        assert [status() for _ in range(3)] == [200, 200, 200]


def test_a_late_answer_of_ps_earlier_start_does_not_teach_its_endpoint_again() -> None:
    """A layerwise request's P answer may arrive after D answered. If P restarted meanwhile
    and the next request failed (D refused the old engine id, the proxy forgot it), that late
    answer names P's earlier start: learning from it sent the request after that to the dead
    engine again (a flaky failure of the test above)."""
    with restartable_p_behind_a_layerwise_proxy(late_first_answer_s=1.5) as (state, status):
        assert status() == 200  # D answered; P's answer is still on its way
        state["engine"] = "P-2"  # P restarted
        assert status() == 502  # D refused the old engine id: the proxy forgets it
        time.sleep(2.0)  # P's late answer (naming P-1) lands
        assert [status() for _ in range(3)] == [200, 200, 200]


def test_a_prefill_instance_whose_endpoint_was_unavailable_is_asked_again() -> None:
    """Only a 404 from `/v1/kv_endpoint` (a P without one, e.g. vLLM) is remembered; a P that
    answered 503 (starting up) is asked again on the next layerwise request (its classic
    answer here names no side channel to learn from)."""
    asked: list[int] = []
    app = FastAPI()

    @app.get("/v1/kv_endpoint")
    async def endpoint() -> JSONResponse:
        asked.append(1)
        if len(asked) == 1:
            return JSONResponse({"error": {"message": "starting"}}, status_code=503)
        return JSONResponse({"remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1})

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        return JSONResponse({"choices": [{"text": "x", "index": 0}], "kv_transfer_params": {"do_remote_prefill": True}})

    with ExitStack() as stack:
        p_url = stack.enter_context(serve_in_thread(app))
        d_url = stack.enter_context(serve_in_thread(answering_decode_app()))
        proxy = stack.enter_context(serve_in_thread(build_proxy_app([p_url], [d_url], timeout_s=30.0, mode="layerwise")))
        for _ in range(2):
            assert httpx.post(f"{proxy}/v1/completions", json={"prompt": "hi"}, timeout=10).status_code == 200
    assert len(asked) == 2
