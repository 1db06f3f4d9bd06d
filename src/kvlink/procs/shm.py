"""Shared-memory segments a stopped process group left behind in /dev/shm.

vLLM's processes talk through POSIX shared memory: the message queues between its engine and
workers (Python's `multiprocessing.shared_memory`, names `psm_*`), with TP the CPU all-reduce
buffers (`vllm_dist_*`), and multiprocessing's semaphores (`sem.mp-*`). A server stopped by
signal to its whole group does not always unlink them, and a killed one never does, so each
stop used to leave a few MB in RAM (tmpfs) for good. `remove_orphans` unlinks such a segment
once no live process has it open or mapped, under its name or any other (by inode): whoever
created it is gone, and nobody can still be reading it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

SHM_DIR = Path("/dev/shm")
PREFIXES = ("psm_", "vllm_dist_", "sem.mp-")


class InUse(NamedTuple):
    """What live processes hold under the shared-memory directory: inode numbers, and names.
    The inode is what counts: a process that created a segment under a temporary name and
    linked it to its final one (glibc's `sem_open` does, so multiprocessing's semaphores are
    made so) maps it under the temporary name, since unlinked. The name is kept as a second
    key for a file system whose maps report another inode than `stat` does."""

    names: set[str]
    inodes: set[int]

    def holds(self, name: str, inode: int) -> bool:
        return name in self.names or inode in self.inodes


def segments_in_use(proc: Path = Path("/proc"), shm_dir: Path = SHM_DIR) -> InUse:
    """The segments under `shm_dir` some live process maps or holds open, among the processes
    this one may inspect. One it may not (another user's, or one with privileges this one
    lacks, e.g. a sandbox's init) is taken to hold none: `remove_orphans` only considers
    segments of this user that only this user can open (mode 0600)."""
    prefix = str(shm_dir) + "/"
    used = InUse(set(), set())
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "maps"), encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at < 0:
                        continue
                    used.names.add(line[at + len(prefix):].rstrip("\n").removesuffix(" (deleted)"))
                    fields = line[:at].split()  # address perms offset dev inode
                    if len(fields) >= 5 and fields[4].isdigit():
                        used.inodes.add(int(fields[4]))
            fds = os.path.join(entry.path, "fd")
            for fd in os.listdir(fds):
                link = os.path.join(fds, fd)
                try:
                    target = os.readlink(link)
                    if target.startswith(prefix):
                        used.names.add(target[len(prefix):].removesuffix(" (deleted)"))
                        used.inodes.add(os.stat(link).st_ino)
                except FileNotFoundError:
                    continue
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited while we looked: it holds nothing any more
        except PermissionError:
            continue  # not ours to inspect (see above)
    return used


def remove_orphans(since: float, prefixes: Iterable[str] = PREFIXES, shm_dir: Path = SHM_DIR,
                   proc: Path = Path("/proc")) -> list[str]:
    """Unlink this user's private segments (mode 0600) named with one of `prefixes`, created
    (or resized) at or after `since` (epoch seconds), that no live process maps or holds open.
    Returns the names removed."""
    if not shm_dir.is_dir():
        return []
    wanted = tuple(prefixes)
    candidates = []
    for entry in os.scandir(shm_dir):
        if not entry.name.startswith(wanted):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o600 and st.st_ctime >= since:
            candidates.append((entry.name, st.st_ino))
    if not candidates:
        return []
    used = segments_in_use(proc, shm_dir)
    removed = []
    for name, inode in candidates:
        if used.holds(name, inode):
            continue
        try:
            (shm_dir / name).unlink()
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed
