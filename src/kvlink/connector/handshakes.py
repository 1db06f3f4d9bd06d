"""Background handshakes: network fetches run in threads, NIXL calls stay on the engine thread.

One fetch per remote key is in flight at a time, so concurrent requests to a new
engine share it; a failed fetch is reported once and forgotten (the next request retries).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvlink.transfer.side_channel import fetch_payload
from kvlink.transfer.wire import HandshakePayload

Payloads = dict[int, HandshakePayload]


class HandshakeRunner:
    def __init__(self, timeout_s: float, secret: bytes | None) -> None:
        self.timeout_s = timeout_s
        self._secret = secret
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvlink-handshake")
        self._futures: dict[Hashable, Future[Payloads]] = {}
        self.started = 0

    def request(self, key: Hashable, host: str, port_base: int, engine_id: str, ranks: Sequence[int]) -> None:
        """Start fetching `ranks` of an engine (rank r listens on `port_base + r`) unless in flight."""
        if key in self._futures:
            return
        self.started += 1
        self._futures[key] = self._pool.submit(self._fetch, host, port_base, engine_id, tuple(ranks))

    def _fetch(self, host: str, port_base: int, engine_id: str, ranks: tuple[int, ...]) -> Payloads:
        return {
            r: fetch_payload(host, port_base + r, engine_id, r, self.timeout_s, secret=self._secret)
            for r in ranks
        }

    def pending(self, key: Hashable) -> bool:
        return key in self._futures

    def take_done(self) -> list[tuple[Hashable, Payloads | BaseException]]:
        done = [k for k, f in self._futures.items() if f.done()]
        out: list[tuple[Hashable, Payloads | BaseException]] = []
        for key in done:
            future = self._futures.pop(key)
            exc = future.exception()
            out.append((key, exc if exc is not None else future.result()))
        return out

    def shutdown(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
