"""`kvlink bench transfer --memory`: cpu is the default and unchanged; cuda refuses clearly
where it cannot run (no CUDA device, or a KV check that reads host memory). The GPU run
itself is measured on a GPU machine (BENCHMARKS.md, "GPU memory")."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvlink.bench.transfer import BenchOptions, cuda_unavailable, memcpy_label
from kvlink.bench.transfer_node import KvBuffer
from kvlink.transfer import agent as agent_module

no_cuda = pytest.mark.skipif(cuda_unavailable() is None, reason="this machine has a CUDA device")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlink.cli.main", "bench", "transfer", *args],
                          env={**os.environ, "UCX_NET_DEVICES": "lo"}, capture_output=True, text=True,
                          timeout=120)


@no_cuda
def test_cuda_memory_without_a_cuda_device_exits_2_with_the_reason() -> None:
    proc = _cli("--memory", "cuda", "--preset", "smollm2-135m", "--tokens", "32")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "kvlink bench transfer: error: --memory cuda needs" in proc.stderr
    assert "use --memory cpu" in proc.stderr or "cannot be imported" in proc.stderr
    assert "worker processes ready" not in proc.stdout  # refused before any peer started


def test_cuda_memory_refuses_a_kv_check_that_reads_host_memory() -> None:
    proc = _cli("--memory", "cuda", "--verify-kv", "sample", "--tokens", "32")
    assert proc.returncode == 2
    assert "--memory cuda needs --verify-kv off (got sample)" in proc.stderr
    with pytest.raises(ValueError, match="needs --verify-kv off"):
        BenchOptions(memory="cuda")  # the connector's default check is on
    with pytest.raises(ValueError, match="--memory must be one of cpu, cuda"):
        BenchOptions(memory="gpu")
    assert BenchOptions().memory == "cpu"
    assert BenchOptions(memory="cuda", verify_kv="off").memory == "cuda"


def test_cpu_buffer_is_filled_in_place_and_read_back() -> None:
    buf = KvBuffer(3 * 4096, "cpu")
    assert buf.addr % 4096 == 0 and buf.mem_type == "DRAM" and buf.device_id == 0
    view = buf.host_view()
    assert view.ctypes.data == buf.addr  # host memory: no second copy of the pool
    view[:] = np.arange(view.size, dtype=np.uint64).astype(np.uint8)
    buf.commit(view)
    assert buf.read(4096, 8) == bytes(range(8))
    assert memcpy_label("cpu") == "numpy memcpy" and memcpy_label("cuda") == "torch cuda copy"


def test_the_connector_worker_registers_its_kv_in_the_memory_kind_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """`NixlWorker(mem_type="VRAM")` builds its agent of that kind and registers the KV caches
    with it (the bench's GPU peers pass it); the NIXL calls here are recorded, not made."""
    import kvlink.connector.worker as worker_module
    from kvlink.connector.config import ConnectorConfig
    from kvlink.layout.presets import SMOLLM2_135M

    calls: list[str] = []

    class Raw:
        def register_memory(self, descs: Any, mem_type: str) -> object:
            calls.append(mem_type)
            return object()

        def get_agent_metadata(self) -> bytes:
            return b"meta"

    monkeypatch.setattr(agent_module, "create_raw_agent", lambda name, config: Raw())
    model = SMOLLM2_135M
    worker = worker_module.NixlWorker(ConnectorConfig("G", side_channel_port=0, verify_kv="off"), model,
                                      1, 0, 16, 16, 4, mem_type="VRAM")
    sizes = [4 * 16 * model.num_kv_heads * 2 * model.head_dim * model.dtype_bytes] * model.num_layers
    bases = [0x10000000 + i * 0x100000 for i in range(model.num_layers)]
    try:
        worker.register_kv_caches(bases, sizes)
        assert worker.agent is not None and worker.agent.mem_type == "VRAM"
        assert calls and set(calls) == {"VRAM"}
    finally:
        if worker.server is not None:
            worker.server.close()
    with pytest.raises(ValueError, match="verify_kv 'off'"):  # digests are hashed through host pointers
        worker_module.NixlWorker(ConnectorConfig("G", side_channel_port=0), model, 1, 0, 16, 16, 4, mem_type="VRAM")
