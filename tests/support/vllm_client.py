"""Greedy completions against a vLLM server, with the token ids (tests compare those)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx


def complete(url: str, model: str, prompt: str, max_tokens: int = 16, **extra: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra})


def token_ids(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])


def greedy_token_ids(url: str, model: str, prompts: Iterable[str]) -> dict[str, list[int]]:
    """Each prompt's greedy token ids from one server (a colocated reference)."""
    return {prompt: token_ids(complete(url, model, prompt)) for prompt in prompts}
