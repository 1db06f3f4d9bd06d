"""NIXL notification messages between workers: encode, and decode defensively.

Every message starts with a tag and a protocol version; anything else is dropped by
the caller (and counted), never trusted. Request ids go last so they may contain ':'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

PREFIX = "kvlink1"
MAX_NOTIF_BYTES = 64 * 1024
MAX_HEARTBEAT_IDS = 4096


class BadNotification(ValueError):
    """A notification that is not one of ours, or is malformed."""


@dataclass(frozen=True)
class Done:
    """D -> P: this consumer finished reading `request_id` (or gave up); `expected` consumers notify."""

    request_id: str
    expected: int


@dataclass(frozen=True)
class Heartbeat:
    """D -> P: still interested in these requests; extend their leases."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class PushRequest:
    """D -> P (push mode): write `request_id`'s KV into my blocks; `info` says where."""

    request_id: str
    info: dict[str, Any]


@dataclass(frozen=True)
class Pushed:
    """P -> D (push mode), attached to P's WRITE: the data for D's `request_id` has landed."""

    request_id: str


Notification = Done | Heartbeat | PushRequest | Pushed


def encode(msg: Notification) -> bytes:
    if isinstance(msg, Done):
        return f"{PREFIX}:done:{msg.expected}:{msg.request_id}".encode()
    if isinstance(msg, Heartbeat):
        return f"{PREFIX}:hb:{len(msg.request_ids)}:".encode() + json.dumps(list(msg.request_ids)).encode()
    if isinstance(msg, PushRequest):
        body = json.dumps({"request_id": msg.request_id, "info": msg.info}, separators=(",", ":"))
        return f"{PREFIX}:push:0:".encode() + body.encode()
    return f"{PREFIX}:pushed:0:{msg.request_id}".encode()


def decode(raw: bytes) -> Notification:
    if len(raw) > MAX_NOTIF_BYTES:
        raise BadNotification(f"notification of {len(raw)} bytes exceeds {MAX_NOTIF_BYTES}")
    try:
        text = raw.decode()
        prefix, kind, number, rest = text.split(":", 3)
        count = int(number)
    except (UnicodeDecodeError, ValueError):
        raise BadNotification(f"not a kvlink notification: {raw[:64]!r}") from None
    if prefix != PREFIX:
        raise BadNotification(f"unknown notification protocol {prefix!r}")
    if kind == "done":
        if count <= 0 or not rest:
            raise BadNotification(f"done notification needs a request id and expected > 0: {text[:80]!r}")
        return Done(rest, count)
    if kind == "pushed" and rest:
        return Pushed(rest)
    try:
        body = json.loads(rest)
    except ValueError:
        raise BadNotification(f"malformed {kind} notification body") from None
    if kind == "hb":
        if not (isinstance(body, list) and len(body) <= MAX_HEARTBEAT_IDS
                and all(isinstance(x, str) for x in body)):
            raise BadNotification("heartbeat must carry a list of request ids")
        return Heartbeat(tuple(body))
    if kind == "push":
        if not (isinstance(body, dict) and isinstance(body.get("request_id"), str)
                and isinstance(body.get("info"), dict)):
            raise BadNotification("push request must carry request_id and info")
        return PushRequest(body["request_id"], body["info"])
    raise BadNotification(f"unknown notification kind {kind!r}")
