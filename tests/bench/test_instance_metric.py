"""`instance_state.metric`: sums one metric's samples, optionally only those with a label."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvlink.bench import instance_state

EXPOSITION = """# TYPE kvlink_server_requests_total counter
kvlink_server_requests_total{outcome="ok"} 7
kvlink_server_requests_total{outcome="abort"} 2
kvlink_server_requests_total{outcome="error"} 1
kvlink_server_prompt_tokens_total 400
"""


def test_label_picks_one_outcome_and_no_label_sums_all(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_get(url: str, **_: Any) -> httpx.Response:
        assert url == "http://127.0.0.1:1/metrics"
        return httpx.Response(200, text=EXPOSITION)

    monkeypatch.setattr(instance_state.httpx, "get", fake_get)
    url = "http://127.0.0.1:1"
    assert instance_state.metric(url, "server_requests_total") == 10.0
    assert instance_state.metric(url, "server_requests_total", 'outcome="abort"') == 2.0
    assert instance_state.metric(url, "server_requests_total", 'outcome="cancel"') == 0.0
    assert instance_state.metric(url, "prompt_tokens_total", 'outcome="ok"') == 0.0
