"""`/debug/memory`: RSS and glibc heap totals of the server process; tracing only when asked."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvlink.serve import memory


def test_debug_memory_reports_rss_and_the_malloc_heap(fake_app: Any) -> None:
    with TestClient(fake_app) as client:
        body = client.get("/debug/memory").json()
        trimmed = client.post("/debug/memory/trim").json()
    assert body["rss_kib"] > 1024
    heap = body["malloc_kib"]
    assert heap is not None, "this test machine runs glibc >= 2.33"
    assert heap["in_use"] > 0 and heap["heap_from_system"] >= heap["in_use"] // 2
    assert body["python_top"] is None  # not tracing unless KVLINK_TRACEMALLOC is set
    assert isinstance(trimmed["released"], bool) and trimmed["rss_kib_before"] > 1024


def test_tracing_frames_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.TRACEMALLOC_ENV, raising=False)
    assert memory.tracing_frames() is None
    monkeypatch.setenv(memory.TRACEMALLOC_ENV, "8")
    assert memory.tracing_frames() == 8
    monkeypatch.setenv(memory.TRACEMALLOC_ENV, "yes")
    with pytest.raises(ValueError, match="KVLINK_TRACEMALLOC must be a number of frames from 1 to 100, got 'yes'"):
        memory.tracing_frames()


def test_top_python_allocations_name_source_lines_while_tracing() -> None:
    import tracemalloc

    tracemalloc.start(1)
    try:
        kept = [bytearray(1024) for _ in range(200)]
        top = memory.top_python_allocations(limit=5)
    finally:
        tracemalloc.stop()
    assert top is not None and len(kept) == 200
    assert any("test_memory_debug.py" in entry["where"] and entry["kib"] >= 200 for entry in top)
