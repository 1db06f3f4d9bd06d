"""What one server process's memory is made of, for `/debug/memory`: RSS, glibc malloc, tracemalloc.

RSS alone cannot tell a leak from an allocator that keeps freed memory: glibc's
`mallinfo2` says how much of the heap is in use and how much is free but held,
and `malloc_trim(0)` hands the free part back (if RSS then drops, nothing leaked).
Python-level allocations are traced only when `KVLINK_TRACEMALLOC` is set before
start-up (it names the frames kept per allocation; tracing slows the server).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import tracemalloc
from pathlib import Path
from typing import Any

TRACEMALLOC_ENV = "KVLINK_TRACEMALLOC"
_MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallinfo2"):  # glibc < 2.33, or not glibc (musl)
        return None
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


_LIBC = _libc()


def tracing_frames() -> int | None:
    """Frames per traced allocation asked for by `KVLINK_TRACEMALLOC` (None: don't trace)."""
    frames = os.environ.get(TRACEMALLOC_ENV)
    if not frames:
        return None
    if not frames.isdigit() or not 1 <= int(frames) <= 100:
        raise ValueError(f"{TRACEMALLOC_ENV} must be a number of frames from 1 to 100, got {frames!r}; "
                         "unset it to run without tracing")
    return int(frames)


def rss_kib(pid: int | str = "self") -> int:
    """Resident set size of `pid` in KiB, from /proc (0 if the process is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def malloc_kib() -> dict[str, int] | None:
    """glibc heap totals over all arenas in KiB (None without glibc's `mallinfo2`)."""
    if _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return {"heap_from_system": info.arena // 1024, "mmapped": info.hblkhd // 1024,
            "in_use": info.uordblks // 1024, "free_held": info.fordblks // 1024}


def trim() -> bool:
    """`malloc_trim(0)`: return free heap pages to the system; False if nothing was released."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


def top_python_allocations(limit: int = 15) -> list[dict[str, Any]] | None:
    """The `limit` source lines holding the most traced Python memory (None when not tracing)."""
    if not tracemalloc.is_tracing():
        return None
    stats = tracemalloc.take_snapshot().statistics("lineno")[:limit]
    return [{"where": str(s.traceback), "kib": s.size // 1024, "blocks": s.count} for s in stats]


def snapshot() -> dict[str, Any]:
    """The body of `/debug/memory`."""
    traced = tracemalloc.get_traced_memory()[0] // 1024 if tracemalloc.is_tracing() else None
    return {"rss_kib": rss_kib(), "malloc_kib": malloc_kib(), "python_traced_kib": traced,
            "python_top": top_python_allocations()}
