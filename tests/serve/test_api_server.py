"""The OpenAI-compatible app over a fake engine: bodies, SSE, stop strings, errors, metrics."""

from __future__ import annotations

import json
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
    ]
    with TestClient(fake_app) as client:
        for request, expected in cases:
            response = client.post("/v1/completions", json=request)
            assert response.status_code == 400, request
            error = response.json()["error"]
            assert expected in error["message"], (request, error)
            assert error["type"] == "invalid_request_error"


def test_engine_error_before_first_token_is_an_http_error(fake_app: Any) -> None:
    with TestClient(fake_app) as client:
        response = client.post("/v1/completions", json={"prompt": "fail", "stream": True})
    assert response.status_code == 500
    assert "simulated KV load failure" in response.json()["error"]["message"]


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
            httpx.post(f"{url}/v1/completions", json={"prompt": "slow", "max_tokens": 60}, timeout=0.3)
        deadline = time.monotonic() + 3
        while not fake_engine.aborted:
            assert time.monotonic() < deadline, "the request kept running after its client left"
            time.sleep(0.05)
    assert not fake_engine.running
