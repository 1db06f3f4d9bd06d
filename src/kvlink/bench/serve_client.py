"""A streaming chat client that times one answer: TTFT, gaps between tokens, and kvlink's figures.

Through the proxy, the answer also says where the time to first token went: the
`x-kvlink-prefill-s` header (P's share) and D's `kvlink` object in the final chunk
(KV bytes, transfer time, D's own time to first token).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

PREFILL_HEADER = "x-kvlink-prefill-s"


@dataclass
class Answer:
    text: str = ""
    ttft_s: float = 0.0  # as the client saw it
    total_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # client clock of each content chunk
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    kv_bytes: int | None = None
    kv_transfer_s: float | None = None
    decode_ttft_s: float | None = None  # D's time to first token (includes the KV move)
    prefill_s: float | None = None  # time spent at P, from the proxy

    @property
    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    def split(self) -> dict[str, float] | None:
        """Client TTFT cut into P prefill, KV move, D compute, and the rest (HTTP, proxy)."""
        if self.prefill_s is None or self.decode_ttft_s is None or self.kv_transfer_s is None:
            return None
        decode_compute = max(0.0, self.decode_ttft_s - self.kv_transfer_s)
        other = max(0.0, self.ttft_s - self.prefill_s - self.decode_ttft_s)
        return {"prefill_s": self.prefill_s, "kv_transfer_s": self.kv_transfer_s,
                "decode_s": decode_compute, "other_s": other}


class ServeError(RuntimeError):
    """An instance or the proxy answered with an error."""


def stream_chat(client: httpx.Client, base_url: str, messages: list[dict[str, str]],
                max_tokens: int, **extra: Any) -> Answer:
    """A streaming, greedy chat completion, timed chunk by chunk."""
    return stream(client, base_url, "/v1/chat/completions",
                  {"messages": messages, "max_tokens": max_tokens, **extra})


def stream_completion(client: httpx.Client, base_url: str, prompt: str | list[int],
                      max_tokens: int, **extra: Any) -> Answer:
    """A streaming, greedy completion (`prompt` as text or token ids), timed chunk by chunk."""
    return stream(client, base_url, "/v1/completions",
                  {"prompt": prompt, "max_tokens": max_tokens, **extra})


def stream(client: httpx.Client, base_url: str, path: str, request: dict[str, Any],
           headers: dict[str, str] | None = None) -> Answer:
    """POST `request` with streaming and greedy sampling; collect text, timings and figures."""
    body = {"temperature": 0, **request, "stream": True, "stream_options": {"include_usage": True}}
    answer = Answer()
    pieces: list[str] = []
    started = time.monotonic()
    with client.stream("POST", base_url + path, json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise ServeError(f"{base_url} answered HTTP {response.status_code}: {response.text[:300]}")
        if PREFILL_HEADER in response.headers:
            answer.prefill_s = float(response.headers[PREFILL_HEADER])
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise ServeError(f"{base_url} failed mid-stream: {event['error'].get('message')}")
            _take_event(event, answer, pieces, time.monotonic())
    answer.total_s = time.monotonic() - started
    if answer.chunk_times:
        answer.ttft_s = answer.chunk_times[0] - started
    answer.text = "".join(pieces)
    return answer


def _take_event(event: dict[str, Any], answer: Answer, pieces: list[str], now: float) -> None:
    for choice in event.get("choices") or []:
        content = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        if content:
            pieces.append(content)
            answer.chunk_times.append(now)
        if choice.get("finish_reason"):
            answer.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if usage:
        answer.completion_tokens = int(usage.get("completion_tokens", 0))
        answer.prompt_tokens = int(usage.get("prompt_tokens", 0))
    figures = event.get("kvlink")
    if isinstance(figures, dict):
        answer.kv_bytes = figures.get("kv_bytes")
        answer.kv_transfer_s = figures.get("kv_transfer_s")
        answer.decode_ttft_s = figures.get("ttft_s")
