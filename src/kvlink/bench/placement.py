"""Where each process of a local deployment runs: cores and torch threads per role."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvlink.layout.limits import THREADS, bounded, check_fields


@dataclass(frozen=True)
class Placement:
    """Cores and torch threads per process, so that P/D and colocated get a stated CPU share."""

    prefill_cpus: tuple[int, ...] | None = None  # each P instance
    decode_cpus: tuple[int, ...] | None = None  # each D instance
    colocated_cpus: tuple[int, ...] | None = None
    threads_per_rank: int = bounded(THREADS, 1)
    colocated_threads: int = bounded(THREADS, 1)

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def pinned(cls) -> Placement:
        """P on core 0 and D on core 1 (one thread each); colocated on both cores, two threads.

        Falls back to unpinned when fewer than two cores are available.
        """
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            return cls()
        return cls((cores[0],), (cores[1],), (cores[0], cores[1]), 1, 2)

    def describe(self) -> str:
        def where(cpus: tuple[int, ...] | None) -> str:
            return "unpinned" if cpus is None else "core" + ("s " if len(cpus) > 1 else " ") + \
                ",".join(map(str, cpus))

        return (f"P {where(self.prefill_cpus)}, D {where(self.decode_cpus)} "
                f"({self.threads_per_rank} torch thread per rank); colocated "
                f"{where(self.colocated_cpus)} ({self.colocated_threads} torch threads); "
                "proxy and client unpinned")
