"""Response bodies and SSE chunks for completions and chat completions, shaped like OpenAI's.

`kv_transfer_params` rides at the top level of the final body or chunk, as vLLM
puts it, so a P/D router reads P's answer without knowing anything else. A D
instance that loaded the KV adds a non-standard `kvlink` object there too (KV bytes,
transfer time, time to first token); OpenAI clients ignore unknown fields.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["completion", "chat"]


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ResponseShape:
    """Knows how one request's answer is spelled: ids, object names, where the text goes."""

    kind: Kind
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    def full(
        self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
        kv_transfer_params: dict[str, Any] | None, figures: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            body = self._envelope("chat.completion")
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            body = self._envelope("text_completion")
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body["choices"] = [choice]
        body["usage"] = usage(prompt_tokens, completion_tokens)
        body["kv_transfer_params"] = kv_transfer_params
        if figures is not None:
            body["kvlink"] = figures
        return body

    def chunk(
        self, text: str | None, finish_reason: str | None = None, *, first: bool = False,
        kv_transfer_params: dict[str, Any] | None = None, figures: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            body = self._envelope("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            body = self._envelope("text_completion")
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason}
        body["choices"] = [choice]
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        if figures is not None:
            body["kvlink"] = figures
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj)
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
