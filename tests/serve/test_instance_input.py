"""What an instance takes from a client beyond the body's sampling fields: the request id it
names the request by, the chat template's options, and the role it serves."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from serve_fakes import FakeEngine, FakeSampling, FakeTokenizer

from kvlink.serve.api_server import build_app
from kvlink.serve.engine_loop import AsyncEngine
from kvlink.serve.metrics import MetricsRegistry

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def decode_app(fake_engine: FakeEngine) -> Iterator[Any]:
    engine = AsyncEngine(fake_engine, request_timeout_s=1.0, idle_wait_s=0.01)
    engine.start()
    yield build_app(engine, FakeTokenizer(), "fake-model", "decode", MetricsRegistry("kvlink_server"),
                    max_model_len=64, sampling_factory=FakeSampling)
    engine.shutdown()


@pytest.mark.parametrize("rid", ["r" * 257, "naïve", "tab\there"])
def test_a_request_id_a_notification_could_not_carry_is_a_400(fake_app: Any, fake_engine: FakeEngine,
                                                             rid: str) -> None:
    with TestClient(fake_app) as client:
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                               headers={"X-Request-Id": rid.encode()})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "x-request-id"
    assert not fake_engine.seen


def test_a_request_id_of_256_printable_characters_names_the_request(fake_app: Any) -> None:
    rid = "r:|=" + "x" * 252
    with TestClient(fake_app) as client:
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                               headers={"X-Request-Id": rid})
    assert response.status_code == 200 and response.json()["id"].endswith(rid)


def test_a_decode_instance_refuses_to_keep_kv_for_a_decoder(decode_app: Any, fake_engine: FakeEngine) -> None:
    """Nothing would hand its blocks back: only a prefill instance has /v1/kv_release."""
    with TestClient(decode_app) as client:
        refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                       "kv_transfer_params": {"do_remote_decode": True}})
        plain = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                     "kv_transfer_params": {"do_remote_decode": False}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
    assert "--role prefill" in refused.json()["error"]["message"]
    assert plain.status_code == 200
    assert len(fake_engine.seen) == 1


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("echo", True, "echo=true is not supported"),
    ("continue_final_message", True, "continue_final_message=true is not supported"),
    ("chat_template", "{{ messages }}", "chat_template is not supported"),
    ("chat_template_kwargs", {"messages": []}, "chat_template_kwargs may not set ['messages']"),
    ("add_generation_prompt", "sometimes", "add_generation_prompt"),
])
def test_chat_options_kvlink_does_not_honour_are_400s(fake_app: Any, field: str, value: Any,
                                                      expected: str) -> None:
    with TestClient(fake_app) as client:
        response = client.post("/v1/chat/completions", json={**CHAT, field: value})
    assert response.status_code == 400, response.text
    assert expected in response.json()["error"]["message"]


def test_add_generation_prompt_and_template_kwargs_reach_the_template(fake_app: Any) -> None:
    tokenizer = FakeTokenizer()
    with TestClient(fake_app) as client:
        usage = [client.post("/v1/chat/completions", json={**CHAT, **extra}).json()["usage"]["prompt_tokens"]
                 for extra in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"x": 1}},
                               {"echo": False, "continue_final_message": False, "chat_template": None})]
    assert usage[0] - usage[1] == len(tokenizer.encode("<assistant>"))
    assert usage[2] == usage[3] == usage[0]
