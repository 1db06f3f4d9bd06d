"""A reader (D) dies while its READ waits on a holder (P) that is not progressing, over UCX TCP.

Found by the fault suite: with `UCX_TLS=tcp` the READ is a software GET that P answers
from its own UCX worker. If D dies after posting and before P's worker runs again (P
frozen, or its only NIXL caller, the engine thread, busy in a long step), UCX aborts the
P process (`ucp_request.inl: Fatal: unexpected error: Endpoint timeout`). Over the
default transports (CMA) P takes no part in a READ and survives. NIXL's progress thread
(`kvlink serve --progress-thread`) answers the GET at once, so a busy engine thread no
longer opens that window. Raw agents, no kvlink server: this pins the UCX behaviour
that RELIABILITY.md relies on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

HOLDER = r"""
import sys, time, numpy as np
from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.agent_config import AgentConfig
work, progress_thread = sys.argv[1], sys.argv[2] == "1"
buf = np.ones(64 << 20, dtype=np.uint8)
agent = NixlAgent("holder", AgentConfig(progress_thread=progress_thread))
agent.register_regions([(buf.ctypes.data, buf.nbytes)])
open(work + "/md", "wb").write(agent.metadata())
open(work + "/addr", "w").write(str(buf.ctypes.data))
busy = work + "/busy"
while True:
    agent.get_notifs()
    if open(busy).read() == "1":
        time.sleep(2.0)  # a long engine step: no NIXL call from this thread
        open(busy, "w").write("0")
    time.sleep(0.001)
"""

READER = r"""
import sys, time, numpy as np
from kvlink.transfer.agent import NixlAgent
work = sys.argv[1]
addr = int(open(work + "/addr").read())
buf = np.zeros(64 << 20, dtype=np.uint8)
agent = NixlAgent("reader")
agent.register_regions([(buf.ctypes.data, buf.nbytes)])
name = agent.add_remote(open(work + "/md", "rb").read())
n, size = 64, 1 << 20
local = agent.prep_local(np.array([[buf.ctypes.data + i * size, size, 0] for i in range(n)], dtype=np.uint64))
remote = agent.prep_remote(name, np.array([[addr + i * size, size, 0] for i in range(n)], dtype=np.uint64))
while True:
    t = agent.post("READ", local, np.arange(n), remote, np.arange(n), b"done")
    while agent.poll(t) != "DONE":
        pass
    agent.release(t)
    print("READ-DONE", flush=True)
    time.sleep(1.0)
"""


def _wait(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _reader_dies_while_holder_busy(work: Path, progress_thread: bool) -> tuple[bool, str]:
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    (work / "busy").write_text("0")
    holder_log, reader_log = work / "holder.log", work / "reader.log"
    with open(holder_log, "wb") as hl:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(work), "1" if progress_thread else "0"],
                                  stdout=hl, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    reader = None
    try:
        _wait(lambda: (work / "addr").exists(), 30, "holder ready")
        with open(reader_log, "wb") as rl:
            reader = subprocess.Popen([sys.executable, "-c", READER, str(work)], stdout=rl,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _wait(lambda: "READ-DONE" in reader_log.read_text(errors="replace"), 30, "first read")
        time.sleep(0.2)
        (work / "busy").write_text("1")  # the holder stops calling NIXL for 2 s ...
        time.sleep(1.3)  # ... while the reader posts its next READ
        reader.kill()
        reader.wait(10)
        time.sleep(3.0)  # the holder is back to polling by now
        alive = holder.poll() is None
        return alive, holder_log.read_text(errors="replace")
    finally:
        for proc in (reader, holder):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_holder_with_progress_thread_survives_reader_death(tmp_path: Path) -> None:
    alive, log = _reader_dies_while_holder_busy(tmp_path, progress_thread=True)
    assert alive, f"holder died:\n{log[-2000:]}"


def test_holder_without_progress_thread_is_aborted_by_ucx(tmp_path: Path) -> None:
    alive, log = _reader_dies_while_holder_busy(tmp_path, progress_thread=False)
    if alive:
        pytest.fail("the holder survived: UCX no longer aborts here; update RELIABILITY.md "
                    "(the --progress-thread advice for UCX_TLS=tcp) and drop this test")
    assert "Endpoint timeout" in log, log[-2000:]
