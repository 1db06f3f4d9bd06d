"""Single-flight handshakes: concurrent requests for one new remote engine share one fetch.

Successful results are cached until ``forget``; a failure is handed to every
caller waiting on that attempt and is not cached, so the next call retries.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from kvlink.transfer.side_channel import fetch_payload
from kvlink.transfer.wire import HandshakePayload

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """At most one ``produce()`` in flight per key; the caller that starts it runs it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[K, V] = {}
        self._inflight: dict[K, concurrent.futures.Future[V]] = {}
        self.started = 0

    def get(self, key: K, produce: Callable[[], V], wait_timeout_s: float) -> V:
        """The cached value, the result of the attempt in flight, or a fresh ``produce()``.

        Waiters give up with ``TimeoutError`` after ``wait_timeout_s``; the
        producing caller is bounded by ``produce``'s own deadline.
        """
        with self._lock:
            if key in self._done:
                return self._done[key]
            future = self._inflight.get(key)
            leader = future is None
            if future is None:
                future = concurrent.futures.Future()
                self._inflight[key] = future
                self.started += 1
        if not leader:
            try:
                return future.result(timeout=wait_timeout_s)
            except concurrent.futures.TimeoutError as exc:
                raise TimeoutError(f"waited {wait_timeout_s} s for the handshake of {key}") from exc
        try:
            value = produce()
        except BaseException as exc:
            with self._lock:
                del self._inflight[key]
            future.set_exception(exc)
            raise
        with self._lock:
            self._done[key] = value
            del self._inflight[key]
        future.set_result(value)
        return value

    def forget(self, predicate: Callable[[K], bool]) -> int:
        """Drop cached values whose key matches; returns how many were dropped."""
        with self._lock:
            stale = [key for key in self._done if predicate(key)]
            for key in stale:
                del self._done[key]
        return len(stale)


class HandshakeCache:
    """Payloads of remote (engine_id, tp_rank) pairs, fetched once over the side channel."""

    def __init__(self, timeout_s: float = 5.0, secret: bytes | None = None) -> None:
        self.timeout_s = timeout_s
        self._secret = secret
        self._flights: SingleFlight[tuple[str, int], HandshakePayload] = SingleFlight()

    @property
    def fetches_started(self) -> int:
        """Network handshakes started so far (cache hits and joined waits excluded)."""
        return self._flights.started

    def get(self, host: str, port: int, engine_id: str, tp_rank: int) -> HandshakePayload:
        def fetch() -> HandshakePayload:
            return fetch_payload(
                host, port, engine_id, tp_rank, self.timeout_s, secret=self._secret
            )

        return self._flights.get((engine_id, tp_rank), fetch, wait_timeout_s=self.timeout_s + 1.0)

    def forget_engine(self, engine_id: str) -> int:
        """Drop every cached rank of an engine (e.g. after it restarted); returns how many."""
        return self._flights.forget(lambda key: key[0] == engine_id)
