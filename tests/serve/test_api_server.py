"""The OpenAI-compatible app over a fake engine: bodies, SSE, stop strings, errors, metrics."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from serve_fakes import FakeEngine, serve_in_thread


def _events(response: Any) -> list[Any]:
    data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def test_completion_body_has_text_usage_and_finish_reason(fake_app: Any) -> None:
    with TestClient(fake_app) as client:
        body = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4}).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "abcd"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert body["kv_transfer_params"] is None


def test_prefill_role_answer_carries_kv_transfer_params(fake_app: Any) -> None:
    request = {"prompt": [104, 105], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    with TestClient(fake_app) as client:
        body = client.post("/v1/completions", json=request).json()
    assert body["kv_transfer_params"]["remote_engine_id"] == "fake-p"
    assert body["kv_transfer_params"]["do_remote_prefill"] is True


def test_chat_stream_sends_role_then_content_then_usage(fake_app: Any) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
               "stream_options": {"include_usage": True}}
    with TestClient(fake_app) as client:
        response = client.post("/v1/chat/completions", json=request)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "abc"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 3


def test_stop_string_cuts_text_and_aborts_the_request(fake_app: Any, fake_engine: FakeEngine) -> None:
    with TestClient(fake_app) as client:
        body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stop": ["cd"]}).json()
        state = client.get("/debug/state").json()
    assert body["choices"][0]["text"] == "ab"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert state["in_flight"] == 0


def test_bad_requests_get_openai_style_400s(fake_app: Any) -> None:
    cases = [
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "temperature": 5}, "temperature"),
        ({"prompt": "x", "n": 2}, "only n=1"),
        ({"prompt": [1, 999]}, "[0, 256)"),
        ({"prompt": "x" * 70}, "maximum context length is 64"),
        ({"prompt": "x" * 10, "max_tokens": 60}, "reduce max_tokens to at most 54"),
        ({"prompt": "x", "kv_transfer_params": {"bogus": 1}}, "no known mode"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty=0.5 is not supported"),
        ({"prompt": "x", "top_k": 5}, "top_k=5 is not supported"),
        ({"prompt": "x", "repetition_penalty": True}, "repetition_penalty=True is not supported"),
        ({"prompt": "x", "logit_bias": {"7": 3}}, "logit_bias"),
        ({"prompt": "x", "max_tokens": 2, "min_tokens": 4}, "min_tokens=4 is more than the 2 tokens"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "include_stop_str_in_output": "maybe"}, "include_stop_str_in_output"),
        ({"prompt": "x", "skip_special_tokens": [1]}, "skip_special_tokens"),
        ({"prompt": "x", "bad_words": ["no"]}, "bad_words"),
        ({"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
        ({"prompt": "x", "stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"prompt": "x", "stop_token_ids": list(range(2000))}, "stop_token_ids"),
        ({"prompt": "x", "ignore_eos": "maybe"}, "ignore_eos"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
        ({"prompt": ["1", "2"]}, "prompt"),  # not token ids (vLLM would read a batch of two prompts)
        ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
        ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"prompt": "x", "tool_choice": "required"}, "tool_choice"),
    ]
    with TestClient(fake_app) as client:
        for request, expected in cases:
            response = client.post("/v1/completions", json=request)
            assert response.status_code == 400, request
            error = response.json()["error"]
            assert expected in error["message"], (request, error)
            assert error["type"] == "invalid_request_error"


def test_sampling_knobs_at_their_neutral_value_are_accepted(fake_app: Any) -> None:
    """Clients send the OpenAI defaults of knobs we do not implement: those mean "off" and pass;
    NaN (which Python's JSON reads) is no neutral value."""
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "top_k": -1,
               "min_p": 0, "best_of": 1, "logit_bias": {}, "user": "u", "min_tokens": 0,
               "include_stop_str_in_output": None, "skip_special_tokens": None, "guided_json": None,
               "ignore_eos": None, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
               "seed": 2**64 - 1}
    with TestClient(fake_app) as client:
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **neutral}).status_code == 200
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "top_k": 0, "min_tokens": None}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        nan = client.post("/v1/completions", content=b'{"prompt": "x", "frequency_penalty": NaN}',
                          headers={"content-type": "application/json"})
        assert nan.status_code == 400 and "frequency_penalty=nan" in nan.json()["error"]["message"]


def test_text_that_is_not_unicode_is_a_400(fake_app: Any) -> None:
    """A JSON \\u escape can carry a lone surrogate, which no tokenizer takes (was a 500)."""
    with TestClient(fake_app) as client:
        for route, body in (("/v1/completions", b'{"prompt": "\\ud800 x", "max_tokens": 2}'),
                            ("/v1/chat/completions",
                             b'{"messages": [{"role": "user", "content": "x\\udfff"}], "max_tokens": 2}')):
            response = client.post(route, content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400, response.text
            assert "lone surrogate" in response.json()["error"]["message"]


def test_ignore_eos_stop_token_ids_and_min_tokens_reach_the_engine(fake_app: Any, fake_engine: Any) -> None:
    """vLLM's `ignore_eos`, `stop_token_ids` and `min_tokens` are honoured, not dropped: the
    engine gets the end-of-sequence token as a stop token unless `ignore_eos`, plus the
    client's stop ids, and `min_tokens`."""
    with TestClient(fake_app) as client:
        for body in ({}, {"ignore_eos": True}, {"stop_token_ids": [7, 5]},
                     {"ignore_eos": True, "stop_token_ids": [9], "min_tokens": 2}):
            assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}).status_code == 200
    sent = [(s.stop_token_ids, s.ignore_eos, s.min_tokens) for _, s, _ in fake_engine.seen.values()]
    assert sent == [((0,), False, 0), ((), True, 0), ((0, 5, 7), False, 0), ((9,), True, 2)]


@pytest.mark.parametrize(("prompt", "status", "code"), [
    ("fail:kv_load_failed", 502, "kv_load_failed"),  # P dead, unreachable or broke off: retry
    ("fail:kv_load_stalled", 504, "kv_load_timeout"),  # the stall deadline passed: retry
    ("fail:bad_kv_transfer_params", 400, "invalid_kv_transfer_params"),  # never works
    ("fail:forbidden_kv_transfer_params", 403, "forbidden_kv_transfer_params"),
    ("fail", 500, "generation_failed"),  # an engine error with no kind
])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_error_before_first_token_gets_the_status_a_router_acts_on(
        fake_app: Any, prompt: str, status: int, code: str, stream: bool) -> None:
    with TestClient(fake_app) as client:
        response = client.post("/v1/completions", json={"prompt": prompt, "stream": stream})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and "simulated KV load failure" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "retry-after" not in response.headers


def test_error_after_the_first_token_is_an_sse_error_event(fake_app: Any) -> None:
    with TestClient(fake_app) as client:
        response = client.post("/v1/completions", json={"prompt": "late-fail:kv_load_failed",
                                                        "max_tokens": 8, "stream": True})
    assert response.status_code == 200  # sent with the first token
    events = _events(response)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "ab"
    assert events[-1]["error"]["code"] == "kv_load_failed"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404_model_not_found(fake_app: Any, route: str) -> None:
    body = {"prompt": "hi", "max_tokens": 2} if route == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with TestClient(fake_app) as client:
        wrong = client.post(route, json={**body, "model": "gpt-4o"})
        right = client.post(route, json={**body, "model": "fake-model"})
        unnamed = client.post(route, json=body)
    assert wrong.status_code == 404
    assert wrong.json()["error"] == {
        "message": wrong.json()["error"]["message"], "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}
    assert "gpt-4o" in wrong.json()["error"]["message"] and "fake-model" in wrong.json()["error"]["message"]
    assert right.status_code == 200 and unnamed.status_code == 200


def test_unknown_route_is_an_openai_style_404(fake_app: Any) -> None:
    with TestClient(fake_app) as client:
        response = client.post("/v1/embeddings", json={})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert "/v1/embeddings" in response.json()["error"]["message"]
    with TestClient(fake_app) as client:
        wrong_method = client.get("/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert wrong_method.headers.get("allow") == "POST"


def test_busy_engine_is_503_with_retry_after(fake_app: Any, fake_engine: FakeEngine) -> None:
    fake_engine.add_gate = threading.Event()  # add_request waits: the engine does not take it
    try:
        with TestClient(fake_app) as client:
            response = client.post("/v1/completions", json={"prompt": "hi"})
    finally:
        fake_engine.add_gate.set()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_overloaded"
    assert response.headers["retry-after"] == "1"


def test_dead_engine_is_503_with_retry_after(fake_app: Any) -> None:
    with TestClient(fake_app) as client:
        crashed = client.post("/v1/completions", json={"prompt": "crash"})
        after = client.post("/v1/completions", json={"prompt": "hi"})
        health = client.get("/health")
    for response in (crashed, after, health):
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_dead"
        assert response.headers["retry-after"] == "5"


def test_silent_request_gets_504_not_a_hang(fake_app: Any, fake_engine: FakeEngine) -> None:
    with TestClient(fake_app) as client:
        response = client.post("/v1/completions", json={"prompt": "hang"})
    assert response.status_code == 504
    assert "no output for 1s" in response.json()["error"]["message"]


def test_models_health_metrics_and_debug_state(fake_app: Any) -> None:
    with TestClient(fake_app) as client:
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert client.get("/health").json()["status"] == "ok"
        assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
        metrics = client.get("/metrics").text
        state = client.get("/debug/state").json()
    assert 'kvlink_server_requests_total{outcome="ok"} 1' in metrics
    assert "kvlink_server_time_to_first_token_seconds_count 1" in metrics
    assert "kvlink_server_inter_token_latency_seconds_count 1" in metrics
    assert 'kvlink_server_engine_free_blocks{key="0"} 100' in metrics
    assert state["engine"]["running"] == 0


def test_client_gone_before_non_stream_answer_aborts_the_request(
    fake_app: Any, fake_engine: FakeEngine
) -> None:
    with serve_in_thread(fake_app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"prompt": "very-slow", "max_tokens": 50}, timeout=0.3)
        # 50 very slow tokens take 25 s, so on a loaded machine the request cannot end by itself
        # before the abort is seen; 20 s bounds the wait.
        deadline = time.monotonic() + 20
        while not fake_engine.aborted:
            assert time.monotonic() < deadline, "the request kept running after its client left"
            time.sleep(0.05)
    assert not fake_engine.running


def test_metrics_keep_the_engine_gauges_while_the_engine_is_busy(fake_app: Any, fake_engine: FakeEngine) -> None:
    """A scrape while the engine thread is inside a long step (here: held in add_request)
    answers within about half a second with the last engine gauges and their age, instead of
    waiting up to 5 s and leaving the gauges out."""
    with TestClient(fake_app) as client:
        assert 'kvlink_server_engine_free_blocks{key="0"} 100' in client.get("/metrics").text
        fake_engine.add_gate = threading.Event()
        held = threading.Thread(target=lambda: client.post("/v1/completions", json={"prompt": "hi"}))
        held.start()
        try:
            assert fake_engine.adding.wait(5)
            started = time.monotonic()
            busy = client.get("/metrics").text
            waited = time.monotonic() - started
        finally:
            fake_engine.add_gate.set()
            held.join(10)
    assert waited < 3.0, waited  # bounded by the scrape's wait, not the engine's step
    assert 'kvlink_server_engine_free_blocks{key="0"} 100' in busy
    age = [line for line in busy.splitlines() if line.startswith("kvlink_server_engine_stats_age_seconds ")]
    assert len(age) == 1 and float(age[0].split()[1]) >= 0.4
