"""What the benches rely on from `kvlink.procs.launcher`, with real processes: a group member
that outlives its leader is stopped too, a client past its time is stopped, and a process
that cannot be pinned is not left running."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest

from kvlink.procs.launcher import run_logged, start_process, stop_all


def _running_with(marker: str) -> list[int]:
    """PIDs of live (not zombie) processes whose command line holds `marker`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if marker in cmdline and stat[stat.rindex(")") + 2] != "Z":
            pids.append(int(proc.name))
    return pids


def _gone(marker: str, timeout_s: float = 10.0) -> bool:
    """No live process holds `marker` (SIGKILL takes effect when the target next runs)."""
    deadline = time.monotonic() + timeout_s
    while _running_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _sleeper(marker: str, ignore_term: bool = False) -> str:
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore_term else ""
    return f"import signal, time; {ignore}time.sleep(30)  # {marker}"


def test_stop_all_stops_a_member_that_outlives_its_leader(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    # The leader exits on SIGTERM; its child (same group) ignores SIGTERM, as a busy engine may.
    leader = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {_sleeper(marker, True)!r}]); "
              f"time.sleep(30)")
    svc = start_process("leader", [sys.executable, "-c", leader], "", tmp_path)
    try:
        deadline = time.monotonic() + 20.0
        while len(_running_with(marker)) < 2 and time.monotonic() < deadline:  # leader and child
            time.sleep(0.05)
        assert len(_running_with(marker)) == 2, "the child did not start"
    finally:
        stop_all([svc], timeout_s=5.0)
    assert svc.proc.returncode is not None
    assert _gone(marker)


def test_run_logged_stops_a_client_past_its_time(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    with pytest.raises(TimeoutError, match="still running"):
        run_logged("client", [sys.executable, "-c", _sleeper(marker)], tmp_path, timeout_s=0.5)
    assert _gone(marker)
    done = run_logged("client", [sys.executable, "-c", "print('finished')"], tmp_path, timeout_s=30)
    assert done.proc.returncode == 0 and done.log_tail() == "finished"


def test_a_process_that_cannot_be_pinned_is_not_left_running(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    with pytest.raises(OSError):
        start_process("pinned", [sys.executable, "-c", _sleeper(marker)], "", tmp_path, cpus=[4095])
    assert _gone(marker)
