"""Greedy completions against a vLLM server, with the token ids (tests compare those), and the
figures tests read back: vLLM's /metrics, kvlink's per-worker endpoint, idleness."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

KV_BYTES = "vllm:kvlink_bytes_transferred_sum"
KV_LOADS = "vllm:kvlink_bytes_transferred_count"
STAGED = "vllm:kvlink_staged_loads_total"  # loads D ran through its staging pages


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


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of a series over its labels on a Prometheus endpoint (`labels`: a fragment every
    counted line's labels must contain, e.g. 'remote_engine="p1"')."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if (line.startswith(name + "{") and labels in line) or (not labels and line.startswith(name + " ")))


def wait_metric(url: str, name: str, above: float, within_s: float = 5.0) -> float:
    """The series once it is above `above` (stats reach vLLM's API server with a later engine
    step); its value after `within_s` otherwise."""
    deadline = time.monotonic() + within_s
    while (value := metric(url, name)) <= above and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def kvlink_state(metrics_port: int) -> dict[str, Any]:
    """What a kvlink worker (rank 0) holds right now, from its `metrics_port` endpoint."""
    state: dict[str, Any] = httpx.get(f"http://127.0.0.1:{metrics_port}/debug/state", timeout=5).json()
    return state


def wait_idle(url: str, metrics_port: int, within_s: float, name: str = "") -> float:
    """Seconds until vLLM's KV usage at `url` is 0 and kvlink holds nothing there."""
    started = time.monotonic()
    while True:
        usage = metric(url, "vllm:kv_cache_usage_perc")
        state = kvlink_state(metrics_port)
        held = {k: state.get(k) for k in ("leases", "loads_in_flight", "open_transfers", "waiting_for_handshake",
                                          "quarantined_loads")}
        if usage == 0 and not any(held.values()):
            return time.monotonic() - started
        if time.monotonic() - started > within_s:
            raise AssertionError(f"{name or url}: KV usage {usage}, kvlink holds {held} after {within_s:.0f}s")
        time.sleep(0.25)


@dataclass
class PdPair:
    """A P and a D server (each with the `url` of a vLLM server) of one served `model`."""

    p: Any
    d: Any
    model: str

    def tokens(self, prompt: str) -> int:
        resp = httpx.post(self.d.url + "/tokenize", json={"model": self.model, "prompt": prompt}, timeout=10)
        return len(resp.json()["tokens"])

    def run(self, prompt: str, mode: str, p: Any = None, d: Any = None) -> tuple[list[int], dict[str, Any], float]:
        """D's greedy token ids after P prefilled `prompt` (`p`, `d`: other servers than the
        pair's), P's params, and the KV bytes D's connector loaded (in push mode P posts the
        writes: D counts none)."""
        p, d = p or self.p, d or self.d
        first = complete(p.url, self.model, prompt, max_tokens=1, stream=False,
                         kv_transfer_params={"do_remote_decode": True, "transfer_mode": mode})
        assert first.status_code == 200, first.text
        params: dict[str, Any] = first.json()["kv_transfer_params"]
        before, count = metric(d.url, KV_BYTES), metric(d.url, KV_LOADS)
        ids = token_ids(complete(d.url, self.model, prompt, kv_transfer_params=params))
        deadline = time.monotonic() + (5 if mode == "pull" else 0)
        while metric(d.url, KV_LOADS) == count and time.monotonic() < deadline:
            time.sleep(0.1)
        return ids, params, metric(d.url, KV_BYTES) - before


def load_through(p: Any, d: Any, model: str, prompt: Any, mode: str, groups: int, d_ranks: int = 1) -> list[int]:
    """A hybrid model's request through vLLM P (one token, `mode` pull or push) and then D: P
    offers one block list per KV-cache group (`groups`), D loads it exactly once per rank
    (its log: D has `d_ranks` TP ranks),
    checks P's digests (verify_kv's default, over the aliased pages), and answers; its token
    ids. `p` and `d` are the servers (`Service`: url, log_path)."""
    first = complete(p.url, model, prompt, max_tokens=1, stream=False,
                     kv_transfer_params={"do_remote_decode": True, "transfer_mode": mode})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert len(params["remote_block_ids"]) == groups  # one list per KV-cache group
    before = d.log_path.read_text(errors="replace").count("kvlink load ")
    checked = metric(d.url, "vllm:kvlink_kv_verified_units_total")
    answer = token_ids(complete(d.url, model, prompt, kv_transfer_params=params))
    assert d.log_path.read_text(errors="replace").count("kvlink load ") == before + d_ranks  # loaded, not recomputed
    assert wait_metric(d.url, "vllm:kvlink_kv_verified_units_total", checked) > checked
    return answer
