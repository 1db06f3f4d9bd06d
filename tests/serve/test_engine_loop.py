"""AsyncEngine: one engine thread, streamed outputs, aborts on cancel, deadlines, engine death."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from serve_fakes import FakeEngine, FakeSampling

from kvlink.serve.engine_loop import AsyncEngine, EngineDead, RequestTimeout


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


async def _collect(engine: AsyncEngine, request_id: str, prompt: str, max_tokens: int) -> list[int]:
    tokens: list[int] = []
    async for output in engine.generate(request_id, _ids(prompt), FakeSampling(max_tokens)):
        tokens += output.new_token_ids
    return tokens


async def _wait_until(predicate, timeout_s: float = 2.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_concurrent_requests_stream_and_engine_sees_one_thread(
    async_engine: AsyncEngine, fake_engine: FakeEngine
) -> None:
    async def main() -> list[list[int]]:
        return await asyncio.gather(*(_collect(async_engine, f"r{i}", "hi", 5) for i in range(4)))

    results = asyncio.run(main())
    assert results == [[ord(c) for c in "abcde"]] * 4
    assert fake_engine.threads == {async_engine._thread.ident}
    assert threading.get_ident() not in fake_engine.threads


def test_add_request_error_reaches_the_caller(async_engine: AsyncEngine) -> None:
    async def main() -> None:
        agen = async_engine.generate("bad", _ids("x"), FakeSampling(3), {"bogus": 1})
        with pytest.raises(ValueError, match="no known mode"):
            await agen.__anext__()

    asyncio.run(main())
    assert async_engine.in_flight == 0


def test_duplicate_request_id_is_refused(async_engine: AsyncEngine) -> None:
    async def main() -> None:
        first = async_engine.generate("dup", _ids("hang"), FakeSampling(3))
        task = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0.1)
        with pytest.raises(ValueError, match="already in flight"):
            await async_engine.generate("dup", _ids("x"), FakeSampling(3)).__anext__()
        task.cancel()

    asyncio.run(main())


def test_silent_request_times_out_and_is_aborted(
    async_engine: AsyncEngine, fake_engine: FakeEngine
) -> None:
    async def main() -> None:
        with pytest.raises(RequestTimeout, match="no output for 1s"):
            await _collect(async_engine, "slow", "hang", 3)
        await _wait_until(lambda: "slow" in fake_engine.aborted)

    asyncio.run(main())
    assert not fake_engine.running


def test_cancelled_caller_aborts_the_request(
    async_engine: AsyncEngine, fake_engine: FakeEngine
) -> None:
    async def main() -> None:
        task = asyncio.ensure_future(_collect(async_engine, "gone", "hang", 3))
        await _wait_until(lambda: "gone" in fake_engine.running)
        task.cancel()
        await _wait_until(lambda: "gone" in fake_engine.aborted)

    asyncio.run(main())
    assert async_engine.in_flight == 0


def test_caller_cancelled_while_its_request_is_being_added_aborts_it(
    async_engine: AsyncEngine, fake_engine: FakeEngine
) -> None:
    """The client leaves while the engine thread is inside add_request: the add cannot be
    called off any more, so the request must be aborted once it is in (it would otherwise
    run to its end for nobody)."""
    fake_engine.add_gate = threading.Event()

    async def main() -> None:
        task = asyncio.ensure_future(_collect(async_engine, "late", "hang", 3))
        await _wait_until(fake_engine.adding.is_set)
        task.cancel()
        await asyncio.sleep(0.05)
        fake_engine.add_gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_until(lambda: "late" in fake_engine.aborted)
        assert "late" not in fake_engine.running

    asyncio.run(main())
    assert async_engine.in_flight == 0 and async_engine.alive


def test_engine_crash_fails_waiters_and_later_calls(async_engine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(EngineDead, match="simulated engine crash"):
            await _collect(async_engine, "boom", "crash", 3)
        with pytest.raises(EngineDead):
            await async_engine.stats()

    asyncio.run(main())
    assert not async_engine.alive


def test_output_arriving_after_abort_is_dropped(
    async_engine: AsyncEngine, fake_engine: FakeEngine
) -> None:
    async def main() -> None:
        outputs = async_engine.generate("early", _ids("slow"), FakeSampling(50))
        await outputs.__anext__()
        await outputs.aclose()  # the client went away after one token
        await _wait_until(lambda: "early" in fake_engine.aborted)
        await _wait_until(lambda: not fake_engine.has_unfinished())
        assert (await async_engine.stats())["running"] == 0

    asyncio.run(main())
    assert async_engine.alive


def test_a_call_cancelled_before_it_runs_does_not_kill_the_engine(async_engine: AsyncEngine) -> None:
    """A client that leaves while its call waits in the queue (engine busy) must not
    crash the engine thread when the engine gets to it."""
    gate = threading.Event()

    async def main() -> None:
        blocker = asyncio.ensure_future(async_engine.call(lambda engine: gate.wait(5)))
        await asyncio.sleep(0.05)  # the engine thread is now inside the blocking call
        ran: list[bool] = []
        queued = asyncio.ensure_future(async_engine.call(lambda engine: ran.append(True)))
        await asyncio.sleep(0.05)
        queued.cancel()
        await asyncio.sleep(0.05)  # the cancel reaches the queued command on the loop's next turn
        gate.set()
        await blocker
        assert await async_engine.stats() is not None  # the engine thread is alive and serving
        assert not ran, "a cancelled call must not run"
        assert async_engine.alive

    asyncio.run(main())


class _HoldingEngine(FakeEngine):
    """A fake engine that records which finished requests it was told to let go."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[str] = []

    def release_held(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True


def test_a_caller_that_left_after_its_request_finished_lets_it_go() -> None:
    """The abort a leaving caller posts finds its request finished (its last output unread):
    the engine lets it go (a P request's blocks would wait for a lease). Never for a request
    the engine did not take from this caller, or that belongs to another caller."""
    from kvlink.serve.engine_loop import _Stream

    engine = _HoldingEngine()
    loop_engine = AsyncEngine(engine, request_timeout_s=5.0)
    loop = asyncio.new_event_loop()
    try:
        def stream(added: bool) -> _Stream:
            return _Stream(loop, asyncio.Queue(), added=added)

        mine = stream(added=True)
        loop_engine._abort("done", mine)  # finished: no stream left under its id
        never = stream(added=False)
        loop_engine._abort("refused", never)  # the engine never took it
        loop_engine._streams["shared"] = stream(added=True)
        loop_engine._abort("shared", stream(added=True))  # another caller's request under this id
        loop_engine._streams["running"] = running = stream(added=True)
        loop_engine._abort("running", running)  # still in flight: aborted, not released
    finally:
        loop.close()
    assert engine.released == ["done"]
    assert engine.aborted == ["running"] and "shared" in loop_engine._streams
