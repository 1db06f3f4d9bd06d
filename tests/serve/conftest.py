"""Fixtures for serving tests: the fake engine behind an AsyncEngine and a FastAPI app."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from serve_fakes import FakeEngine, FakeSampling, FakeTokenizer

from kvlink.serve.api_server import build_app
from kvlink.serve.engine_loop import AsyncEngine
from kvlink.serve.metrics import MetricsRegistry


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def async_engine(fake_engine: FakeEngine) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(fake_engine, request_timeout_s=1.0, idle_wait_s=0.01)
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture
def fake_app(async_engine: AsyncEngine) -> Any:
    metrics = MetricsRegistry("kvlink_server")
    return build_app(async_engine, FakeTokenizer(), "fake-model", "both", metrics,
                     max_model_len=64, sampling_factory=FakeSampling)
