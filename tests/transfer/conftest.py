"""Fixtures for transfer tests: spawned P peers (stopped by PID) and a D-side agent."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from transfer_peers import BLOCKS, Holder, SpawnHolder

from kvlink.transfer.agent import NixlAgent


@pytest.fixture
def spawn_holder(tmp_path: Path) -> Iterator[SpawnHolder]:
    started: list[Holder] = []

    def spawn(
        name: str, seed: int = 1, blocks: int = BLOCKS, env: dict[str, str] | None = None
    ) -> Holder:
        engine_id = f"engine-{name}"
        log = tmp_path / f"{name}-{len(started)}.log"
        holder = Holder(
            name, engine_id, seed, blocks, {"UCX_NET_DEVICES": "lo", **(env or {})}, log
        )
        started.append(holder)
        return holder

    try:
        yield spawn
    finally:
        for holder in started:
            holder.stop()


@pytest.fixture
def decode_agent() -> Iterator[NixlAgent]:
    agent = NixlAgent(f"decode-{uuid.uuid4().hex[:8]}")
    try:
        yield agent
    finally:
        agent.close()
