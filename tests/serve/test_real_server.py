"""`kvlink serve --role both --model smollm2-135m` as a real process, driven by the openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from kvlink.engine.model import smollm2_gguf_path
from kvlink.engine.tokenizer import Tokenizer
from kvlink.procs.launcher import free_port

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"  # one real model for all tests: a second server start costs ~10s
NUM_BLOCKS = 32
BLOCK_SIZE = 16
MAX_MODEL_LEN = NUM_BLOCKS * BLOCK_SIZE


@contextmanager
def running_server(model: str) -> Iterator[str]:
    """`kvlink serve` as a subprocess; yields its URL once /health answers; stopped by PID."""
    port = free_port()
    command = [sys.executable, "-m", "kvlink.cli.main", "serve", "--role", "both",
               "--model", model, "--port", str(port), "--num-blocks", str(NUM_BLOCKS),
               "--block-size", str(BLOCK_SIZE), "--threads", "1", "--request-timeout-s", "20"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"server exited: {process.stdout.read()}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "server did not become healthy within 60s"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_server(MODEL) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The served model's tokenizer, to name the token ids of an answer."""
    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=30, max_retries=0)


def _assert_no_leaks(server: str) -> None:
    deadline = time.monotonic() + 5
    while True:
        state = httpx.get(f"{server}/debug/state", timeout=5).json()
        engine = state["engine"]
        clean = (state["in_flight"] == 0 and engine["running"] == 0 and engine["waiting"] == 0
                 and engine["held_requests"] == 0 and set(engine["free_blocks"]) == {NUM_BLOCKS})
        if clean:
            return
        assert time.monotonic() < deadline, f"blocks or requests leaked: {state}"
        time.sleep(0.1)


def test_greedy_completion_is_deterministic_and_counts_tokens(client: openai.OpenAI, server: str) -> None:
    first = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=8, temperature=0)
    again = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=8, temperature=0)
    assert first.choices[0].text == again.choices[0].text != ""
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 8
    by_ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=3,
                                       temperature=0)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 3
    _assert_no_leaks(server)


def test_chat_stream_matches_non_stream(client: openai.OpenAI, server: str) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                           temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            temperature=0, stream=True)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    _assert_no_leaks(server)


def test_stop_string_truncates(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                     temperature=0).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                    temperature=0, stop=[stop]).choices[0]
    assert cut.text == text[: text.find(stop)]
    assert cut.finish_reason == "stop"


def test_bad_requests_are_400_with_clear_messages(server: str) -> None:
    cases = [
        ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, f"maximum context length is {MAX_MODEL_LEN}"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": [10**6]}, "token ids must be in [0, 49152)"),
        # colocated: no connector keeps the KV for a decoder (was: 200, empty text, no params)
        ({"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, "no KV connector"),
    ]
    for body, expected in cases:
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=10)
        assert response.status_code == 400, body
        assert expected in response.json()["error"]["message"]
    chat = httpx.post(f"{server}/v1/chat/completions", json={"messages": []}, timeout=10)
    assert chat.status_code == 400 and "messages" in chat.json()["error"]["message"]


def test_client_disconnect_frees_everything(server: str) -> None:
    body = {"prompt": "Tell me a long story", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=10) as response:
        assert next(response.iter_lines()).startswith("data: ")
    _assert_no_leaks(server)
    metrics = httpx.get(f"{server}/metrics", timeout=5).text
    assert 'kvlink_server_requests_total{outcome="abort"}' in metrics
    assert "kvlink_server_time_to_first_token_seconds_count" in metrics


def test_chat_answers_and_stops_at_eos(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                            temperature=0)
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.choices[0].finish_reason == "stop"


def test_ignore_eos_generates_past_the_end_and_stop_token_ids_stop(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """vLLM's extensions, as vLLM does them: `ignore_eos` runs to `max_tokens` through the
    end-of-sequence token (the text leaves the special token out); `stop_token_ids` ends the
    answer at the first of them (left out of the text, counted as generated)."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    short = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage is not None
    long = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length"
    assert long.usage is not None and long.usage.completion_tokens == 24
    text = long.choices[0].message.content or ""
    assert text.startswith(short.choices[0].message.content or "") and "<|im_end|>" not in text

    prompt = "The capital of France is"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    ids = tokenizer.encode(greedy)
    assert tokenizer.decode(ids) == greedy
    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])  # a token not generated before
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"stop_token_ids": [ids[k]]})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == tokenizer.decode(ids[:k])
    assert cut.usage is not None and cut.usage.completion_tokens == k + 1


def test_min_tokens_holds_off_the_end_of_sequence_and_stop_strings(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """vLLM's `min_tokens`: the end-of-sequence token cannot come before it (the answer goes on
    where it would have ended), and a stop string counts only where it ends past the text of
    the first `min_tokens` tokens."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    short = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage is not None
    n = short.usage.completion_tokens
    longer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n + 12, temperature=0,
                                            extra_body={"min_tokens": n + 3})
    assert longer.usage is not None and longer.usage.completion_tokens >= n + 3
    assert (longer.choices[0].message.content or "").startswith(short.choices[0].message.content or "")

    prompt = "The capital of France is"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    ids = tokenizer.encode(greedy)
    assert tokenizer.decode(ids) == greedy
    stop = greedy.strip()[:3]  # begins the answer: without min_tokens the answer is empty
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     stop=[stop]).choices[0].text == greedy[:greedy.find(stop)]
    protected = len(tokenizer.decode(ids[:2]))
    later = greedy[protected + 2:protected + 5]  # a stop string further on
    assert later.strip() and stop not in greedy[protected:]
    for stops in ([stop], [stop, later]):
        at = greedy.find(later) if later in stops else -1
        held = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stops,
                                         extra_body={"min_tokens": 2}).choices[0]
        assert held.text == (greedy[:at] if at >= 0 else greedy), stops
        assert held.finish_reason == ("stop" if at >= 0 else "length")


def test_special_tokens_and_stops_can_stay_in_the_text(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """vLLM's `skip_special_tokens: false` keeps special tokens' text (generated through the end
    of sequence with `ignore_eos`); `include_stop_str_in_output` ends the text with the stop
    string, or with the stop token's text."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    skipped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                             extra_body={"ignore_eos": True})
    kept = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True, "skip_special_tokens": False})
    with_special, without = kept.choices[0].message.content or "", skipped.choices[0].message.content or ""
    assert "<|im_end|>" in with_special and "<|im_end|>" not in without
    assert with_special.startswith(without[:with_special.index("<|im_end|>")])

    prompt = "The capital of France is"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    stop = greedy[3:6]
    ended = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
                                      extra_body={"include_stop_str_in_output": True}).choices[0]
    assert ended.text == greedy[:greedy.find(stop) + len(stop)] and ended.finish_reason == "stop"
    ids = tokenizer.encode(greedy)
    with_token = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"stop_token_ids": [ids[1]], "include_stop_str_in_output": True})
    assert with_token.choices[0].text == tokenizer.decode(ids[:2])
