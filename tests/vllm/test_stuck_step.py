"""The stuck-step watchdog of kvlink's vLLM workers, on its own (no engine): a step past the
limit gets one log line and the stacks of every thread, once; its end is logged."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from kvlink.integrations.vllm.stuck_step import StepWatchdog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_step_past_the_limit_is_reported_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    with open(tmp_path / "stderr", "w") as out:
        dog = StepWatchdog(5.0, "rank 0/2", out=out, clock=clock, run=False)
        assert not dog.check()  # no step yet
        dog.begin()
        clock.now += 4.9
        assert not dog.check()
        with caplog.at_level(logging.WARNING, logger="kvlink.integrations.vllm"):
            clock.now += 0.2
            assert dog.check()
            assert not dog.check()  # once per step
            clock.now += 10
            assert not dog.check()
            dog.end()
        assert "rank 0/2: one engine step has run for 5.1 s (stuck_step_dump_s 5)" in caplog.text
        assert "rank 0/2: the engine step reported stuck ended after 15.1 s" in caplog.text
        caplog.clear()
        dog.begin()  # a healthy step: nothing at its end
        clock.now += 1
        assert not dog.check()
        dog.end()
        assert not dog.check() and caplog.text == ""
        dog.begin()  # the next stuck step is reported again
        clock.now += 6
        assert dog.check()
    assert dog.dumps == 2
    dumped = (tmp_path / "stderr").read_text()
    assert dumped.count("Current thread") == 2 and "test_a_step_past_the_limit_is_reported_once" in dumped


def _a_step_that_hangs(seconds: float) -> None:
    time.sleep(seconds)


def test_the_watchdog_thread_dumps_the_stuck_thread_s_stack(tmp_path: Path) -> None:
    """The real thread, while this one sleeps inside a step (a C call that releases the GIL)."""
    with open(tmp_path / "stderr", "w") as out:
        dog = StepWatchdog(0.2, "rank 1/2", out=out)
        try:
            dog.begin()
            _a_step_that_hangs(1.0)
            dog.end()
            dog.begin()
            dog.end()  # quick steps are never reported
            time.sleep(0.3)
        finally:
            dog.close()
    assert dog.dumps == 1
    dumped = (tmp_path / "stderr").read_text()
    assert dumped.count("Current thread") == 1 and "_a_step_that_hangs" in dumped


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError):
        StepWatchdog(0, "rank 0/1", run=False)
