"""Handshake listener and client: valid fetches, refusals, hostile frames, HMAC, deadlines."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest

from kvlink.transfer import framing, wire
from kvlink.transfer.side_channel import (
    EngineMismatch,
    HandshakeFailed,
    HandshakeRefused,
    HandshakeServer,
    fetch_payload,
)
from kvlink.transfer.wire import HandshakePayload, HandshakeRequest

pytestmark = pytest.mark.timeout(30)
ENGINE = "prefill-engine"


def make_payload(engine_id: str = ENGINE, tp_rank: int = 0) -> HandshakePayload:
    return HandshakePayload(
        version=wire.PROTOCOL_VERSION, engine_id=engine_id, tp_rank=tp_rank, tp_size=2,
        compat_hash="h", agent_name=f"agent-{tp_rank}", agent_metadata=b"md" * 100,
        geometry=b"\x80", sent_time=0.0,
    )  # fmt: skip


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[HandshakeServer]:
    monkeypatch.delenv(framing.SECRET_ENV, raising=False)
    with HandshakeServer(ENGINE, io_timeout_s=0.3) as srv:
        srv.set_payload(0, make_payload(tp_rank=0))
        srv.set_payload(1, make_payload(tp_rank=1))
        yield srv


def raw_exchange(port: int, data: bytes, hold_open: bool = False) -> bytes:
    """Send raw bytes and return whatever comes back before the listener closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=3.0) as sock:
        chunks = []
        try:
            sock.sendall(data)
            if not hold_open:
                sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except OSError:  # reset, broken pipe, not connected: the listener closed on unread bytes
            pass
        return b"".join(chunks)


def test_valid_fetch_per_rank(server: HandshakeServer) -> None:
    before = time.time()
    got = fetch_payload("127.0.0.1", server.port, ENGINE, 1, timeout_s=2.0)
    assert got.agent_name == "agent-1" and got.tp_rank == 1 and got.agent_metadata == b"md" * 100
    assert got.sent_time >= before
    assert server.stats.served == 1 and server.stats.rejected == 0
    assert server.host == "127.0.0.1"


def test_wrong_engine_and_unknown_rank_are_refused(server: HandshakeServer) -> None:
    with pytest.raises(HandshakeRefused, match="serves engine 'prefill-engine', not 'other'"):
        fetch_payload("127.0.0.1", server.port, "other", 0, timeout_s=2.0)
    with pytest.raises(HandshakeRefused, match=r"no payload for rank 5 \(ranks \[0, 1\]\)"):
        fetch_payload("127.0.0.1", server.port, ENGINE, 5, timeout_s=2.0)
    assert server.stats.refused == 2
    with pytest.raises(ValueError, match="expected engine"):
        server.set_payload(2, make_payload(engine_id="other", tp_rank=2))


def test_hostile_frames_are_dropped_and_counted(server: HandshakeServer) -> None:
    header = struct.Struct(">I")
    request = wire.encode(HandshakeRequest(wire.PROTOCOL_VERSION, ENGINE, 0))
    cases = [
        ("oversized", header.pack(wire.MAX_MESSAGE_BYTES + 1) + b"x" * 16),
        ("truncated", header.pack(len(request)) + request[:5]),
        ("random bytes", header.pack(64) + os.urandom(64)),
        ("not a request", framing.pack_frame(wire.encode(wire.HandshakeError("hi")), None)),
    ]
    for case, data in cases:
        assert raw_exchange(server.port, data) == b"", case
    assert raw_exchange(server.port, header.pack(100) + b"slow", hold_open=True) == b""

    stats = server.stats
    assert (stats.oversized, stats.truncated, stats.malformed) == (1, 2, 2)
    assert stats.served == 0
    assert fetch_payload("127.0.0.1", server.port, ENGINE, 0, timeout_s=2.0).tp_rank == 0


def test_wrong_version_gets_a_clear_error(server: HandshakeServer) -> None:
    old = framing.pack_frame(wire.encode(HandshakeRequest(99, ENGINE, 0)), None)
    reply = wire.decode_reply(raw_exchange(server.port, old)[4:])
    assert isinstance(reply, wire.HandshakeError)
    assert "protocol version 99 not supported" in reply.message
    assert server.stats.wrong_version == 1


def test_hmac_on_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(framing.SECRET_ENV, raising=False)
    with HandshakeServer(ENGINE, secret=b"s3cret", io_timeout_s=0.3) as srv:
        srv.set_payload(0, make_payload())
        assert fetch_payload("127.0.0.1", srv.port, ENGINE, 0, 2.0, secret=b"s3cret").tp_rank == 0
        with pytest.raises(HandshakeFailed, match="KVLINK_SECRET"):
            fetch_payload("127.0.0.1", srv.port, ENGINE, 0, 2.0)
        with pytest.raises(HandshakeFailed, match="KVLINK_SECRET"):
            fetch_payload("127.0.0.1", srv.port, ENGINE, 0, 2.0, secret=b"wrong")
        monkeypatch.setenv(framing.SECRET_ENV, "s3cret")
        assert fetch_payload("127.0.0.1", srv.port, ENGINE, 0, 2.0).tp_rank == 0
        assert (srv.stats.served, srv.stats.unauthenticated) == (2, 2)
    monkeypatch.delenv(framing.SECRET_ENV)
    with HandshakeServer(ENGINE, io_timeout_s=0.3) as plain:
        plain.set_payload(0, make_payload())
        with pytest.raises(HandshakeFailed):
            fetch_payload("127.0.0.1", plain.port, ENGINE, 0, 2.0, secret=b"s3cret")
        assert plain.stats.malformed == 1


def test_client_deadline_with_silent_listener() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts in the kernel, never answers
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(HandshakeFailed, match="timed out"):
            fetch_payload("127.0.0.1", port, ENGINE, 0, timeout_s=0.3)
        assert time.monotonic() - started < 1.0


def test_client_checks_the_engine_of_the_reply() -> None:
    """A listener that answers for another engine (stale host/port) is caught by D."""
    with socket.create_server(("127.0.0.1", 0)) as fake:
        port = fake.getsockname()[1]

        def answer() -> None:
            conn, _ = fake.accept()
            with conn:
                framing.read_frame(conn, None, time.monotonic() + 2.0)
                body = msgspec.msgpack.encode(make_payload(engine_id="someone-else"))
                conn.sendall(framing.pack_frame(body, None))

        thread = threading.Thread(target=answer)
        thread.start()
        with pytest.raises(EngineMismatch, match="'someone-else'"):
            fetch_payload("127.0.0.1", port, ENGINE, 0, timeout_s=2.0)
        thread.join(timeout=2.0)
