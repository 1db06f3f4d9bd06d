"""Helpers for transfer tests: a spawned P peer process (holder.py) and D-side wiring to it."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.side_channel import fetch_payload
from kvlink.transfer.xfer import Transfer

HOLDER = Path(__file__).parent / "helpers" / "holder.py"
BLOCKS = 64
BLOCK_BYTES = 16384


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Holder:
    """One holder.py process, started and stopped by PID with bounded waits."""

    def __init__(
        self, name: str, engine_id: str, seed: int, blocks: int, env: dict[str, str], log: Path
    ) -> None:
        self.name, self.engine_id, self.seed, self.blocks = name, engine_id, seed, blocks
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HOLDER), "--name", name, "--engine-id", engine_id,
             "--seed", str(seed), "--blocks", str(blocks), "--block-bytes", str(BLOCK_BYTES)],
            stdout=subprocess.PIPE, stderr=self._log, env={**os.environ, **env}, text=True,
        )  # fmt: skip
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.port = int(self.expect("READY", timeout=20.0).split()[1])

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout: float = 5.0) -> str:
        """The next stdout line starting with ``prefix`` (other lines are skipped)."""
        end = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"holder {self.name}: no {prefix!r} line in {timeout} s"
                ) from None
            if line.startswith(prefix):
                return line

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log.close()


SpawnHolder = Callable[..., Holder]


@dataclass
class Link:
    """D's view of one connected holder: remote name, prepared lists, buffers."""

    agent: NixlAgent
    local: np.ndarray
    local_handle: int
    remote_name: str
    remote_handle: int


def block_descs(base: int, blocks: int, block_bytes: int) -> np.ndarray:
    starts = base + np.arange(blocks, dtype=np.uint64) * np.uint64(block_bytes)
    return np.stack(
        [starts, np.full(blocks, block_bytes, np.uint64), np.zeros(blocks, np.uint64)], 1
    )


def connect(agent: NixlAgent, holder: Holder, local: np.ndarray | None = None) -> Link:
    """Handshake with ``holder`` over the side channel and prepare both descriptor lists."""
    payload = fetch_payload("127.0.0.1", holder.port, holder.engine_id, 0, timeout_s=5.0)
    geometry = msgspec.msgpack.decode(payload.geometry)
    remote_name = agent.add_remote(payload.agent_metadata)
    assert remote_name == payload.agent_name == holder.name
    blocks = geometry["blocks"]
    if local is None:
        local = np.zeros(blocks * BLOCK_BYTES, dtype=np.uint8)
        agent.register_regions([(local.ctypes.data, local.nbytes)])
    local_handle = agent.prep_local(block_descs(local.ctypes.data, blocks, BLOCK_BYTES))
    remote_descs = block_descs(geometry["base"], geometry["blocks"], geometry["block_bytes"])
    remote_handle = agent.prep_remote(remote_name, remote_descs)
    return Link(agent, local, local_handle, remote_name, remote_handle)


def wait_done(agent: NixlAgent, transfer: Transfer, timeout: float = 5.0) -> None:
    """Poll until DONE; fails the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while agent.poll(transfer) != "DONE":
        assert time.monotonic() < end, f"transfer not done within {timeout} s"
