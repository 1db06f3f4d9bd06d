"""Write every thread's stack to the log when one engine step of a vLLM worker runs too long.

Inside a step a worker waits on its TP peers (collectives), on NIXL, on vLLM's queues; when
a step never ends, the engine core only logs that it is waiting for the workers. kvlink's
worker marks where each step begins (vLLM binds the step's connector metadata) and where it
ends (vLLM asks for the step's transfer results). A watchdog thread that finds one step
running for longer than `limit_s` logs one line and writes the stack of every thread of the
process to stderr (the server's log), once per step; the step's end, if it comes, is logged
too. Cost per step: two attribute writes.

The watchdog runs Python, so it needs the GIL: a thread stuck in C code that releases it
(torch ops such as vLLM's CPU all-reduce, sockets, sleeps) is seen; one holding it is not.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("kvlink.integrations.vllm")


class StepWatchdog:
    """Begin/end marks from the worker's thread; the check from the watchdog's own."""

    def __init__(self, limit_s: float, label: str, *, out: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, run: bool = True) -> None:
        if not limit_s > 0:
            raise ValueError(f"limit_s must be positive, got {limit_s!r}")
        self.limit_s = limit_s
        self.label = label
        self._out = out
        self._clock = clock
        self._steps = 0
        self._current: tuple[int, float] | None = None  # (step number, start); swapped whole
        self._reported = 0  # the step whose stacks were written (0: none yet)
        self.dumps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if run:
            self._thread = threading.Thread(target=self._run, name="kvlink-stuck-step", daemon=True)
            self._thread.start()

    def begin(self) -> None:
        self._steps += 1
        self._current = (self._steps, self._clock())

    def end(self) -> None:
        current, self._current = self._current, None
        if current is not None and current[0] == self._reported:
            log.warning("%s: the engine step reported stuck ended after %.1f s", self.label,
                        self._clock() - current[1])

    def check(self) -> bool:
        """Report the running step if it passed the limit and was not reported yet."""
        current = self._current
        if current is None or current[0] == self._reported:
            return False
        took = self._clock() - current[1]
        if took < self.limit_s:
            return False
        self._reported = current[0]
        self.dumps += 1
        log.warning("%s: one engine step has run for %.1f s (stuck_step_dump_s %g); the stacks of "
                    "this process's threads follow on stderr", self.label, took, self.limit_s)
        out = self._out or sys.stderr
        try:
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        except (OSError, ValueError, AttributeError):  # stderr replaced by one without a file descriptor
            if sys.__stderr__ is not None:
                faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        return True

    def _run(self) -> None:
        interval = min(self.limit_s / 4, 1.0)
        while not self._stop.wait(interval):
            try:
                self.check()
            except Exception:  # never let the watchdog take the worker down
                log.exception("%s: the stuck-step check failed", self.label)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
