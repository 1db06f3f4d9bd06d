"""The memory kind of a `NixlAgent` (DRAM or VRAM) reaches NIXL's register and prepare calls.

A fake stands in for the raw NIXL agent only to see which kind each call names (no GPU
here); the real VRAM path is measured on a GPU (BENCHMARKS.md, "GPU memory"). The last
test registers and reads host memory through real NIXL with the default kind.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

from kvlink.transfer import agent as agent_module
from kvlink.transfer.agent import NixlAgent


class _Native:
    def release(self) -> None:
        pass


class _FakeRaw:
    """Records the memory kind of every register and prepare call."""

    def __init__(self) -> None:
        self.registered: list[tuple[list[list[int]], str]] = []
        self.prepared: list[tuple[str, list[list[int]], str]] = []

    def register_memory(self, descs: Any, mem_type: str) -> object:
        self.registered.append((np.asarray(descs).tolist(), mem_type))
        return object()

    def deregister_memory(self, reg: object) -> None:
        pass

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return b"peer"

    def remove_remote_agent(self, name: str) -> None:
        pass

    def prep_xfer_dlist(self, remote: str, descs: Any, mem_type: str) -> _Native:
        self.prepared.append((remote, np.asarray(descs).tolist(), mem_type))
        return _Native()


@pytest.fixture
def fake_raw(monkeypatch: pytest.MonkeyPatch) -> _FakeRaw:
    raw = _FakeRaw()
    monkeypatch.setattr(agent_module, "create_raw_agent", lambda name, config: raw)
    return raw


def test_default_kind_is_dram_as_before(fake_raw: _FakeRaw) -> None:
    agent = NixlAgent("a")
    assert agent.mem_type == "DRAM"
    agent.register_regions([(0x1000, 4096)])
    agent.prep_local([[0x1000, 4096, 0]])
    agent.prep_remote(agent.add_remote(b"blob"), [[0x8000, 4096, 0]])
    assert fake_raw.registered == [([[0x1000, 4096, 0]], "DRAM")]
    assert [(r, k) for r, _, k in fake_raw.prepared] == [("", "DRAM"), ("peer", "DRAM")]


def test_vram_agent_registers_and_prepares_vram_with_the_device_id(fake_raw: _FakeRaw) -> None:
    agent = NixlAgent("v", mem_type="VRAM")
    assert agent.register_regions([(0x7F0000000000, 1 << 20)], device_id=3) == 1
    agent.prep_local([[0x7F0000000000, 4096, 3]])
    agent.prep_remote(agent.add_remote(b"blob"), [[0x7E0000000000, 4096, 3]])
    assert fake_raw.registered == [([[0x7F0000000000, 1 << 20, 3]], "VRAM")]
    assert fake_raw.prepared == [("", [[0x7F0000000000, 4096, 3]], "VRAM"),
                                 ("peer", [[0x7E0000000000, 4096, 3]], "VRAM")]


def test_a_call_may_name_another_kind(fake_raw: _FakeRaw) -> None:
    """A host-memory table beside a GPU KV cache: one agent, two kinds."""
    agent = NixlAgent("v", mem_type="VRAM")
    agent.register_regions([(0x1000, 4096)], mem_type="DRAM")
    agent.prep_local([[0x1000, 4096, 0]], mem_type="DRAM")
    agent.prep_local([[0x2000, 4096, 0]])
    assert [k for _, k in fake_raw.registered] == ["DRAM"]
    assert [k for _, _, k in fake_raw.prepared] == ["DRAM", "VRAM"]


def test_unknown_kinds_and_device_ids_are_refused(fake_raw: _FakeRaw) -> None:
    with pytest.raises(ValueError, match="mem_type must be one of DRAM, VRAM, got 'cuda'"):
        NixlAgent("x", mem_type="cuda")  # type: ignore[arg-type]
    agent = NixlAgent("x")
    with pytest.raises(ValueError, match="mem_type must be one of"):
        agent.prep_local([[0x1000, 4096, 0]], mem_type="FILE")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device_id must be >= 0"):
        agent.register_regions([(0x1000, 4096)], device_id=-1)
    assert fake_raw.registered == [] and fake_raw.prepared == []


def test_real_nixl_default_kind_still_moves_host_memory() -> None:
    """Unchanged behaviour through real NIXL: a DRAM agent READs from a second one."""
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    with NixlAgent(f"src-{uuid.uuid4().hex[:8]}") as a, NixlAgent(f"dst-{uuid.uuid4().hex[:8]}") as b:
        a.register_regions([(src.ctypes.data, src.nbytes)])
        b.register_regions([(dst.ctypes.data, dst.nbytes)])
        peer = b.add_remote(a.metadata())
        a.add_remote(b.metadata())
        local = b.prep_local([[dst.ctypes.data, dst.nbytes, 0]])
        remote = b.prep_remote(peer, [[src.ctypes.data, src.nbytes, 0]])
        transfer = b.post("READ", local, [0], remote, [0])
        for _ in range(100_000):
            a.get_notifs()
            if b.poll(transfer) == "DONE":
                break
        b.release(transfer)
    assert np.array_equal(src, dst)
