"""Single-flight handshakes: one network fetch for many concurrent callers; failures not cached."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from test_side_channel import ENGINE, make_payload

from kvlink.transfer import framing
from kvlink.transfer.handshake_cache import HandshakeCache, SingleFlight
from kvlink.transfer.side_channel import HandshakeRefused, HandshakeServer
from kvlink.transfer.wire import HandshakePayload

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[HandshakeServer]:
    monkeypatch.delenv(framing.SECRET_ENV, raising=False)
    with HandshakeServer(ENGINE) as srv:
        yield srv


def test_fifty_concurrent_callers_share_one_handshake(server: HandshakeServer) -> None:
    server.set_payload(0, make_payload())
    cache = HandshakeCache(timeout_s=5.0)
    start = threading.Barrier(50)
    results: list[HandshakePayload] = []
    errors: list[BaseException] = []

    def caller() -> None:
        start.wait(timeout=5.0)
        try:
            results.append(cache.get("127.0.0.1", server.port, ENGINE, 0))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10.0)
    assert not errors and len(results) == 50
    assert all(result is results[0] for result in results)
    assert server.stats.served == 1 and cache.fetches_started == 1


def test_failure_is_not_cached_and_forget_refetches(server: HandshakeServer) -> None:
    cache = HandshakeCache(timeout_s=2.0)
    with pytest.raises(HandshakeRefused, match="no payload for rank 0"):
        cache.get("127.0.0.1", server.port, ENGINE, 0)
    server.set_payload(0, make_payload())
    assert cache.get("127.0.0.1", server.port, ENGINE, 0).tp_rank == 0
    assert cache.get("127.0.0.1", server.port, ENGINE, 0).tp_rank == 0
    assert cache.fetches_started == 2 and server.stats.served == 1

    assert cache.forget_engine(ENGINE) == 1
    cache.get("127.0.0.1", server.port, ENGINE, 0)
    assert cache.fetches_started == 3 and server.stats.served == 2


def test_waiters_see_the_leaders_failure() -> None:
    flights: SingleFlight[str, int] = SingleFlight()
    entered, release = threading.Event(), threading.Event()
    outcomes: list[object] = []

    def failing() -> int:
        entered.set()
        release.wait(timeout=5.0)
        raise ConnectionError("peer down")

    def leader() -> None:
        try:
            flights.get("e", failing, wait_timeout_s=5.0)
        except ConnectionError as exc:
            outcomes.append(exc)

    thread = threading.Thread(target=leader)
    thread.start()
    assert entered.wait(timeout=5.0)
    waiter = threading.Thread(target=leader)
    waiter.start()
    release.set()
    thread.join(timeout=5.0)
    waiter.join(timeout=5.0)
    assert len(outcomes) == 2 and flights.started == 1
    assert flights.get("e", lambda: 7, wait_timeout_s=1.0) == 7 and flights.started == 2
