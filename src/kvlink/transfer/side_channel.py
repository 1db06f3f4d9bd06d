"""Handshake side channel: P's per-rank payload listener and D's ``fetch_payload`` client.

One request per TCP connection: D sends a ``HandshakeRequest`` frame, P answers
with the rank's ``HandshakePayload`` or a ``HandshakeError`` and closes. Bad
frames are logged, counted and dropped without disturbing other clients.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, replace

import msgspec

from kvlink.transfer import framing, wire
from kvlink.transfer.wire import HandshakeError, HandshakePayload, HandshakeRequest

logger = logging.getLogger(__name__)


class HandshakeFailed(ConnectionError):
    """D could not get a usable payload from P's side channel."""


class HandshakeRefused(HandshakeFailed):
    """P's listener answered with a ``HandshakeError``."""


class EngineMismatch(HandshakeFailed):
    """The payload came from another engine than the one asked for."""


@dataclass
class ListenerStats:
    """Counters of a ``HandshakeServer``; rejected connections get no payload."""

    served: int = 0
    oversized: int = 0
    truncated: int = 0
    malformed: int = 0
    wrong_version: int = 0
    unauthenticated: int = 0
    refused: int = 0
    busy: int = 0
    internal_errors: int = 0

    @property
    def rejected(self) -> int:
        return (
            self.oversized
            + self.truncated
            + self.malformed
            + self.wrong_version
            + self.unauthenticated
            + self.refused
            + self.busy
            + self.internal_errors
        )


class HandshakeServer:
    """Serves, for each TP rank of one engine, the payload that rank registered."""

    def __init__(
        self,
        engine_id: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        io_timeout_s: float = 2.0,
        max_connections: int = 64,
    ) -> None:
        self.engine_id = engine_id
        self._secret = framing.resolve_secret(secret)
        self._io_timeout_s = io_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._payloads: dict[int, HandshakePayload] = {}
        self._stats = ListenerStats()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self.host, self.port = self._sock.getsockname()[:2]
        self._thread = threading.Thread(
            target=self._accept_loop, name="kvlink-handshake", daemon=True
        )
        self._thread.start()
        logger.info(
            "handshake listener for engine %s on %s:%d (auth=%s)",
            engine_id,
            self.host,
            self.port,
            self._secret is not None,
        )

    def set_payload(self, tp_rank: int, payload: HandshakePayload) -> None:
        if payload.engine_id != self.engine_id or payload.tp_rank != tp_rank:
            raise ValueError(
                f"payload is for engine {payload.engine_id!r} rank {payload.tp_rank}, "
                f"expected engine {self.engine_id!r} rank {tp_rank}"
            )
        with self._lock:
            self._payloads[tp_rank] = payload

    @property
    def stats(self) -> ListenerStats:
        with self._lock:
            return replace(self._stats)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2.0)
        self._sock.close()

    def __enter__(self) -> HandshakeServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _count(self, counter: str, peer: object, detail: str) -> None:
        with self._lock:
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        if counter != "served":
            logger.warning(
                "handshake listener %s: rejected %s (%s): %s", self.port, peer, counter, detail
            )

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._count("busy", peer, "too many concurrent connections")
                conn.close()
                continue
            threading.Thread(target=self._serve_one, args=(conn, peer), daemon=True).start()

    def _serve_one(self, conn: socket.socket, peer: object) -> None:
        try:
            with conn:
                self._handle(conn, peer, time.monotonic() + self._io_timeout_s)
        except OSError as exc:
            self._count("truncated", peer, f"socket error: {exc}")
        except Exception:
            logger.exception("handshake listener %s: unexpected error serving %s", self.port, peer)
            self._count("internal_errors", peer, "unexpected error")
        finally:
            self._slots.release()

    def _handle(self, conn: socket.socket, peer: object, deadline: float) -> None:
        try:
            body = framing.read_frame(conn, self._secret, deadline)
            version = wire.peek_version(body)
            if version != wire.PROTOCOL_VERSION:
                message = f"protocol version {version} not supported; listener speaks {wire.PROTOCOL_VERSION}"
                self._count("wrong_version", peer, message)
                self._reply(conn, HandshakeError(message), deadline)
                return
            request = wire.decode_request(body)
        except framing.FrameTooLarge as exc:
            self._count("oversized", peer, str(exc))
        except framing.FrameAuthFailed as exc:
            self._count("unauthenticated", peer, str(exc))
        except framing.FrameError as exc:
            self._count("truncated", peer, str(exc))
        except wire.WireError as exc:
            self._count("malformed", peer, str(exc))
        else:
            self._answer(conn, peer, request, deadline)

    def _answer(
        self, conn: socket.socket, peer: object, request: HandshakeRequest, deadline: float
    ) -> None:
        with self._lock:
            payload = self._payloads.get(request.tp_rank)
            ranks = sorted(self._payloads)
        if request.engine_id != self.engine_id:
            message = f"this listener serves engine {self.engine_id!r}, not {request.engine_id!r}"
        elif payload is None:
            message = f"engine {self.engine_id!r} has no payload for rank {request.tp_rank} (ranks {ranks})"
        else:
            reply = msgspec.structs.replace(payload, sent_time=time.time())
            self._count("served", peer, "")  # before sending, so a client never sees a stale count
            self._reply(conn, reply, deadline)
            return
        self._count("refused", peer, message)
        self._reply(conn, HandshakeError(message), deadline)

    def _reply(
        self, conn: socket.socket, message: HandshakePayload | HandshakeError, deadline: float
    ) -> None:
        framing.send_frame(conn, wire.encode(message), self._secret, deadline)


def fetch_payload(
    host: str,
    port: int,
    engine_id: str,
    tp_rank: int,
    timeout_s: float,
    *,
    secret: bytes | None = None,
) -> HandshakePayload:
    """Ask P's listener for one rank's payload; everything happens before ``timeout_s``."""
    where = f"handshake with {host}:{port} (engine {engine_id!r}, rank {tp_rank})"
    secret = framing.resolve_secret(secret)
    deadline = time.monotonic() + timeout_s
    request = wire.encode(HandshakeRequest(wire.PROTOCOL_VERSION, engine_id, tp_rank))
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            framing.send_frame(sock, request, secret, deadline)
            body = framing.read_frame(sock, secret, deadline)
        reply = wire.decode_reply(body)
    except framing.FrameTruncated as exc:
        raise HandshakeFailed(
            f"{where}: listener closed without a reply ({exc}); "
            f"if it requires a shared secret, check {framing.SECRET_ENV} (or --secret-file) "
            "on both sides"
        ) from exc
    except framing.FrameAuthFailed as exc:
        raise HandshakeFailed(
            f"{where}: reply failed authentication; shared secrets differ"
        ) from exc
    except (OSError, wire.WireError, msgspec.MsgspecError) as exc:
        raise HandshakeFailed(f"{where} failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(reply, HandshakeError):
        raise HandshakeRefused(f"{where} refused: {reply.message}")
    if reply.version != wire.PROTOCOL_VERSION:
        raise HandshakeFailed(
            f"{where}: payload has protocol version {reply.version}, "
            f"expected {wire.PROTOCOL_VERSION}"
        )
    if reply.engine_id != engine_id or reply.tp_rank != tp_rank:
        raise EngineMismatch(
            f"{where}: got the payload of engine {reply.engine_id!r} rank {reply.tp_rank}; "
            "the remote_host/remote_port point at another engine than remote_engine_id"
        )
    return reply
