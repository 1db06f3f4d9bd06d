"""`kvlink.procs.shm`: segments left in /dev/shm by stopped process groups are unlinked, and
only those: not one a live process maps or holds open, not one older than the sweep's start,
not one of another name."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from kvlink.procs.launcher import start_process, stop_all
from kvlink.procs.shm import SHM_DIR, remove_orphans, segments_in_use


def make(path: Path, size: int = 4096, mode: int = 0o600) -> Path:
    path.write_bytes(b"\0" * size)
    path.chmod(mode)
    return path


def test_only_segments_nobody_uses_are_removed(tmp_path: Path) -> None:
    since = time.time() - 1
    orphan = make(tmp_path / "psm_orphan")
    dist = make(tmp_path / "vllm_dist_x-tp:0-[0-1]-cpushm")
    other = make(tmp_path / "ucx_shm_posix_1")
    shared = make(tmp_path / "psm_shared", mode=0o644)  # others may open it: not known unused
    mapped = make(tmp_path / "psm_mapped")
    opened = make(tmp_path / "psm_opened")
    with open(mapped, "r+b") as f:
        view = mmap.mmap(f.fileno(), 0)  # mapped, file closed
    fd = os.open(opened, os.O_RDONLY)
    try:
        assert {"psm_mapped", "psm_opened"} <= segments_in_use(shm_dir=tmp_path).names
        removed = remove_orphans(since, shm_dir=tmp_path)
        assert sorted(removed) == sorted([orphan.name, dist.name])
        assert not orphan.exists() and not dist.exists()
        assert other.exists() and shared.exists() and mapped.exists() and opened.exists()
    finally:
        view.close()
        os.close(fd)
    # Released: now nobody uses them.
    assert sorted(remove_orphans(since, shm_dir=tmp_path)) == ["psm_mapped", "psm_opened"]


def test_a_segment_mapped_under_another_name_stays(tmp_path: Path) -> None:
    """glibc's sem_open makes a semaphore under a temporary name, maps it, links it to its
    final name and unlinks the temporary one: the creator's maps name only the temporary file,
    '(deleted)'. The inode shows it in use."""
    since = time.time() - 1
    temporary = make(tmp_path / "sem.Ab12Cd")
    with open(temporary, "r+b") as f:
        view = mmap.mmap(f.fileno(), 0)
    os.link(temporary, tmp_path / "sem.mp-linked")
    temporary.unlink()
    try:
        assert remove_orphans(since, shm_dir=tmp_path) == []
        assert (tmp_path / "sem.mp-linked").exists()
    finally:
        view.close()
    assert remove_orphans(since, shm_dir=tmp_path) == ["sem.mp-linked"]


def test_a_live_multiprocessing_semaphore_stays() -> None:
    """The real thing: a spawn-context lock's named semaphore in /dev/shm, held by this
    process, is not swept (a sweep once removed a live vLLM server's, and its engine could
    not start)."""
    since = time.time() - 1
    lock = multiprocessing.get_context("spawn").Lock()
    name = "sem." + lock._semlock.name.lstrip("/")  # type: ignore[attr-defined]
    assert (SHM_DIR / name).exists()
    remove_orphans(since, prefixes=("sem.mp-",))
    assert (SHM_DIR / name).exists()
    # a spawned child can still open it by name
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_take, args=(lock,))
    child.start()
    try:
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=10)


def _take(lock: object) -> None:
    with lock:  # type: ignore[attr-defined]
        pass


def test_segments_older_than_the_sweep_stay(tmp_path: Path) -> None:
    old = make(tmp_path / "psm_old")
    assert remove_orphans(time.time() + 60, shm_dir=tmp_path) == []
    assert old.exists()


def test_a_missing_directory_is_nothing_to_do(tmp_path: Path) -> None:
    assert remove_orphans(0, shm_dir=tmp_path / "absent") == []


def test_stop_all_unlinks_what_a_killed_group_left(tmp_path: Path) -> None:
    """A real process creates a POSIX shared-memory segment (as vLLM's queues do) and is
    killed with its group; `stop_all` unlinks the segment. Another, held by this process,
    stays."""
    name = f"psm_kvlinktest_{uuid.uuid4().hex[:8]}"
    kept = SHM_DIR / f"psm_kvlinktest_{uuid.uuid4().hex[:8]}"
    code = ("import mmap, os, sys, time\n"
            f"fd = os.open('/dev/shm/{name}', os.O_CREAT | os.O_RDWR, 0o600)\n"
            "os.ftruncate(fd, 1 << 16)\n"
            "m = mmap.mmap(fd, 1 << 16)\n"
            "os.close(fd)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    svc = start_process("shm-maker", [sys.executable, "-c", code], "http://127.0.0.1:1", tmp_path)
    make(kept)
    fd = os.open(kept, os.O_RDONLY)
    try:
        deadline = time.monotonic() + 30
        while "ready" not in svc.log_path.read_text():
            assert svc.proc.poll() is None and time.monotonic() < deadline, svc.log_tail()
            time.sleep(0.05)
        assert (SHM_DIR / name).exists()
        os.killpg(svc.proc.pid, signal.SIGKILL)  # as a fault test kills a server: nothing cleans up
        svc.proc.wait(timeout=10)
        assert (SHM_DIR / name).exists()
        stop_all([svc])
        assert not (SHM_DIR / name).exists()
        assert kept.exists()
    finally:
        os.close(fd)
        for path in (SHM_DIR / name, kept):
            path.unlink(missing_ok=True)
