"""`AsyncEngine`: one background thread owns the single-threaded engine; asyncio callers stream.

Every engine call (`add_request`, `abort`, `step`, `stats`) runs on the engine
thread. Callers post commands to it and receive outputs through per-request
asyncio queues fed with `loop.call_soon_threadsafe`, so the event loop never
blocks on a forward pass and the engine never sees two threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger("kvlink.serve")


class EngineLike(Protocol):
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: Any,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[Any]: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> dict[str, Any]: ...


class RequestTimeout(Exception):
    """A request produced nothing for `request_timeout_s`; it was aborted in the engine."""


class EngineOverloaded(Exception):
    """The engine thread did not take a new request within `request_timeout_s` (busy stepping)."""


class EngineDead(Exception):
    """The engine thread stopped after an exception; no request can be served."""


@dataclass
class _Command:
    fn: Callable[[Any], Any]
    result: concurrent.futures.Future[Any]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[Any]
    added: bool = False  # the engine took the request (set on the engine thread)


BACKGROUND_POLL_S = 0.001
# An idle engine still steps this often: a peer's notification may need an answer though no
# request is here (a layerwise D cancelling a push request this P never got the prompt of).
IDLE_STEP_S = 0.25


class AsyncEngine:
    """Serves an `EngineLike` to asyncio code. Start with `start()`, stop with `shutdown()`."""

    def __init__(
        self, engine: EngineLike, *, request_timeout_s: float = 120.0, idle_wait_s: float = 0.05,
    ) -> None:
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._post_lock = threading.Lock()  # orders posting against `dead_reason` being set
        self._stopping = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched only on the engine thread
        self._in_flight = 0  # touched only on event loops; read by gauges
        self.dead_reason: str | None = None
        self._thread = threading.Thread(target=self._run, name="kvlink-engine", daemon=True)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead_reason is None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the engine thread and return its result (or raise its error)."""
        return await asyncio.wrap_future(self._post(fn))

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.call(lambda engine: engine.stats())
        return result

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling: Any,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """Yield the engine's outputs for one request until one is `finished`.

        Raises what `add_request` raises (bad input), `EngineOverloaded` when the engine does
        not take the request within `request_timeout_s`, `RequestTimeout` when nothing
        arrives for that long after, `EngineDead` if the engine thread fails.
        Closing the iterator early (client gone, task cancelled) aborts the request.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def add(engine: EngineLike) -> None:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight; use a unique id")
            engine.add_request(request_id, prompt_ids, sampling, kv_transfer_params)
            self._streams[request_id] = stream
            stream.added = True

        try:
            await asyncio.wait_for(self.call(add), self.request_timeout_s)
        except asyncio.CancelledError:
            # The caller left while `add` was queued (then it is skipped) or already running
            # (then the request is in): either way, abort whatever `add` put in.
            self._post(lambda engine: self._abort(request_id, stream))
            raise
        except asyncio.TimeoutError:
            self._post(lambda engine: self._abort(request_id, stream))  # runs after `add` if it ever does
            raise EngineOverloaded(
                f"the engine did not accept request {request_id} within "
                f"{self.request_timeout_s:g}s; it is overloaded or stuck: retry later or elsewhere"
            ) from None
        self._in_flight += 1
        finished = False
        try:
            while not finished:
                try:
                    output = await asyncio.wait_for(stream.outputs.get(), self.request_timeout_s)
                except asyncio.TimeoutError:
                    raise RequestTimeout(
                        f"request {request_id} produced no output for {self.request_timeout_s:g}s "
                        "and was aborted"
                    ) from None
                if isinstance(output, BaseException):
                    finished = True
                    raise output
                finished = bool(output.finished)
                yield output
        finally:
            self._in_flight -= 1
            if not finished:
                self._post(lambda engine: self._abort(request_id, stream))

    async def release_remote_prefill(
        self, prompt_ids: list[int], sampling: Any, kv_transfer_params: dict[str, Any],
    ) -> bool:
        """A decode instance refused a request whose prompt a prefill engine already holds
        (e.g. max_tokens past the context): enter it and abort it at once, so the connector
        tells P to free its blocks now instead of when the lease runs out. False if the
        engine refused the request itself (bad params or prompt): then P holds nothing we
        could name, or its lease frees it."""
        request_id = f"refused-{uuid.uuid4().hex}"

        def release(engine: EngineLike) -> bool:
            try:
                engine.add_request(request_id, prompt_ids, sampling, kv_transfer_params)
            except ValueError:
                return False
            engine.abort(request_id)
            return True

        released: bool = await self.call(release)
        return released

    async def release_by_params(self, kv_transfer_params: dict[str, Any]) -> bool:
        """P: free the blocks held for params a router hands back unused (`LLMEngine.release_by_params`)."""
        released: bool = await self.call(lambda engine: engine.release_by_params(kv_transfer_params))
        return released

    def _post(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        command = _Command(fn, concurrent.futures.Future())
        with self._post_lock:
            if self.dead_reason is not None:
                command.result.set_exception(EngineDead(self.dead_reason))
                return command.result
            self._commands.put(command)
        self._wake.set()
        return command.result

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if not command.result.set_running_or_notify_cancel():
                continue  # the caller gave up (client left) before the engine got to it
            try:
                command.result.set_result(command.fn(self.engine))
            except Exception as error:  # handed to the caller, who decides
                command.result.set_exception(error)

    def _fail_everything(self, reason: str) -> None:
        with self._post_lock:
            self.dead_reason = reason
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDead(reason), final=True)
        while True:
            try:
                result = self._commands.get_nowait().result
                if result.set_running_or_notify_cancel():
                    result.set_exception(EngineDead(reason))
            except queue.Empty:
                return

    def _abort(self, request_id: str, stream: _Stream | None = None) -> None:
        """Abort `request_id` if it is still in flight (and, given `stream`, only if it is that
        caller's request, not another one under the same id). A request of this caller that
        finished before the caller read its last output is let go in the engine: a P
        request's blocks wait under a lease for a decoder nobody told."""
        current = self._streams.get(request_id)
        if current is None:
            if stream is None or stream.added:
                self._release_held(request_id)
            return
        if stream is not None and current is not stream:
            return  # another caller's request under this id
        del self._streams[request_id]
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("engine.abort(%s) failed", request_id)

    def _release_held(self, request_id: str) -> None:
        release = getattr(self.engine, "release_held", None)
        if release is None:
            return
        try:
            release(request_id)
        except Exception:
            logger.exception("engine.release_held(%s) failed", request_id)

    def _deliver(self, request_id: str, item: Any, final: bool) -> None:
        stream = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if stream is None:
            return  # aborted by its caller: the output has nobody to go to
        # A closed caller loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)

    def _run(self) -> None:
        last_step = time.monotonic()
        try:
            while not self._stopping.is_set():
                self._run_commands()
                # has_unfinished() also covers connector work (leases, loads) with no request.
                busy = self.engine.has_unfinished()
                if busy or time.monotonic() - last_step >= IDLE_STEP_S:
                    outputs = self.engine.step()
                    last_step = time.monotonic()
                    for output in outputs:
                        self._deliver(output.request_id, output, bool(output.finished))
                    if outputs:
                        continue
                # Nothing produced: poll connector work (leases, loads in flight) without
                # spinning a core, or, idle, wait for a request.
                self._wake.wait(BACKGROUND_POLL_S if busy else self.idle_wait_s)
                self._wake.clear()
        except Exception as error:
            logger.exception("engine thread stopped")
            self._fail_everything(f"engine step failed: {error!r}")
            return
        self._run_commands()  # aborts posted just before shutdown still reach the engine
        self._fail_everything("the engine was shut down")
