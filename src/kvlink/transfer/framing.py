"""Length-prefixed, optionally HMAC-authenticated frames over a blocking TCP socket.

A frame is a 4-byte big-endian length, then (when a secret is set) a 32-byte
HMAC-SHA256 of the body, then the msgpack body. Every read has a deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

from kvlink.transfer.wire import MAX_MESSAGE_BYTES

SECRET_ENV = "KVLINK_SECRET"
MAC_BYTES = 32
_HEADER = struct.Struct(">I")


class FrameError(ConnectionError):
    """The peer sent something that is not a valid frame, or sent it too slowly."""


class FrameTooLarge(FrameError):
    pass


class FrameTruncated(FrameError):
    pass


class FrameTimeout(FrameError):
    pass


class FrameAuthFailed(FrameError):
    pass


def resolve_secret(secret: bytes | None) -> bytes | None:
    """An explicit secret wins; otherwise ``$KVLINK_SECRET`` (UTF-8) if set and non-empty."""
    if secret is not None:
        return secret or None
    from_env = os.environ.get(SECRET_ENV, "")
    return from_env.encode() if from_env else None


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


def pack_frame(body: bytes, secret: bytes | None) -> bytes:
    prefix = _mac(secret, body) if secret else b""
    return _HEADER.pack(len(prefix) + len(body)) + prefix + body


def send_frame(sock: socket.socket, body: bytes, secret: bytes | None, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))
    try:
        sock.sendall(pack_frame(body, secret))
    except TimeoutError as exc:
        raise FrameTimeout("timed out sending a frame") from exc


def read_frame(sock: socket.socket, secret: bytes | None, deadline: float) -> bytes:
    """Read one frame and return its body; raises a ``FrameError`` subclass on bad input."""
    (length,) = _HEADER.unpack(_read_exact(sock, _HEADER.size, deadline, allow_eof=True))
    limit = MAX_MESSAGE_BYTES + (MAC_BYTES if secret else 0)
    if length > limit:
        raise FrameTooLarge(f"frame of {length} bytes exceeds the {limit}-byte limit")
    payload = _read_exact(sock, length, deadline, allow_eof=False)
    if not secret:
        return payload
    if length < MAC_BYTES:
        raise FrameAuthFailed("frame too short to carry an HMAC")
    mac, body = payload[:MAC_BYTES], payload[MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(secret, body)):
        raise FrameAuthFailed("frame HMAC does not match (wrong or missing shared secret)")
    return body


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FrameTimeout("deadline passed")
    return left


def _read_exact(sock: socket.socket, count: int, deadline: float, allow_eof: bool) -> bytes:
    chunks: list[bytes] = []
    received = 0
    while received < count:
        sock.settimeout(_remaining(deadline))
        try:
            chunk = sock.recv(min(count - received, 1 << 20))
        except TimeoutError as exc:
            raise FrameTimeout(f"timed out after {received} of {count} bytes") from exc
        if not chunk:
            what = "connection closed" if allow_eof and received == 0 else "truncated frame"
            raise FrameTruncated(f"{what}: got {received} of {count} bytes")
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)
