"""NIXL notification messages between workers: encode, and decode defensively.

Every message starts with a tag and a protocol version; anything else is dropped by
the caller (and counted), never trusted. Request ids go last so they may contain ':'.
With a shared secret (`KVLINK_SECRET`) every message ends with `|mac=<HMAC-SHA256 hex>`
of what precedes it: a peer that can reach our NIXL agent but lacks the secret cannot
end or extend a lease, or ask for a push.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any

PREFIX = "kvlink1"
MAX_NOTIF_BYTES = 64 * 1024
MAX_HEARTBEAT_IDS = 4096
MAX_REQUEST_ID_BYTES = 4096
"""P's request ids in params and notifications (UTF-8): a Done naming one always decodes."""
_TAG = b"|mac="
_TAG_LEN = len(_TAG) + 64
_TAG_RE = re.compile(rb"\|mac=[0-9a-f]{64}\Z")


class BadNotification(ValueError):
    """A notification that is not one of ours, or is malformed."""


class UnauthenticatedNotification(BadNotification):
    """A notification without a valid HMAC tag while a secret is configured (or the reverse)."""


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
    """P -> D (push mode), attached to P's WRITE: the data for D's `request_id` has landed.
    Layerwise, P also names the blocks it prefilled into (D had no params from P to learn
    them from, and its digest check reads P's digests of those blocks)."""

    request_id: str
    remote_block_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class Cancel:
    """D -> P (push and layerwise): D's `d_request_id` (rank `d_rank` of `d_engine_id`) was
    aborted while P still had to write it, which P knows as `request_id` (or by that key):
    write no more into its blocks, and say so."""

    request_id: str
    d_request_id: str
    d_engine_id: str
    d_rank: int


@dataclass(frozen=True)
class Cancelled:
    """P -> D, answering `Cancel`: nothing of ours is or will be in flight into the blocks of
    D's `request_id`; D may give them back now."""

    request_id: str


Notification = Done | Heartbeat | PushRequest | Pushed | Cancel | Cancelled


def encode(msg: Notification, secret: bytes | None = None) -> bytes:
    body = _encode_body(msg)
    if not secret:
        return body
    return body + _TAG + hmac.new(secret, body, hashlib.sha256).hexdigest().encode()


def _encode_body(msg: Notification) -> bytes:
    if isinstance(msg, Done):
        return f"{PREFIX}:done:{msg.expected}:{msg.request_id}".encode()
    if isinstance(msg, Heartbeat):
        return f"{PREFIX}:hb:{len(msg.request_ids)}:".encode() + json.dumps(list(msg.request_ids),
                                                                          separators=(",", ":")).encode()
    if isinstance(msg, PushRequest):
        body = json.dumps({"request_id": msg.request_id, "info": msg.info}, separators=(",", ":"))
        return f"{PREFIX}:push:0:".encode() + body.encode()
    if isinstance(msg, Cancel):
        body = json.dumps({"request_id": msg.request_id, "d_request_id": msg.d_request_id,
                           "d_engine_id": msg.d_engine_id, "d_rank": msg.d_rank}, separators=(",", ":"))
        return f"{PREFIX}:cancel:0:".encode() + body.encode()
    if isinstance(msg, Cancelled):
        return f"{PREFIX}:cancelled:0:{msg.request_id}".encode()
    if msg.remote_block_ids is not None:
        body = json.dumps({"request_id": msg.request_id, "remote_block_ids": msg.remote_block_ids},
                          separators=(",", ":"))
        return f"{PREFIX}:pushed:1:".encode() + body.encode()
    return f"{PREFIX}:pushed:0:{msg.request_id}".encode()


def encode_heartbeats(request_ids: tuple[str, ...] | list[str], secret: bytes | None = None) -> list[bytes]:
    """Heartbeats naming every id in `request_ids`, as many messages as it takes for each to
    stay within what `decode` accepts (bytes and ids). An id too long for a message of its
    own is left out: P issues no params for one (`MAX_REQUEST_ID_BYTES`), and D refuses them."""
    room = MAX_NOTIF_BYTES - (_TAG_LEN if secret else 0) - len(f"{PREFIX}:hb:{MAX_HEARTBEAT_IDS}:[]")
    out: list[bytes] = []
    batch: list[str] = []
    size = 0
    for rid in request_ids:
        cost = len(json.dumps(rid).encode()) + 1  # the id and its comma
        if cost > room:
            continue
        if batch and (size + cost > room or len(batch) == MAX_HEARTBEAT_IDS):
            out.append(encode(Heartbeat(tuple(batch)), secret))
            batch, size = [], 0
        batch.append(rid)
        size += cost
    if batch:
        out.append(encode(Heartbeat(tuple(batch)), secret))
    return out


def decode(raw: bytes, secret: bytes | None = None) -> Notification:
    if len(raw) > MAX_NOTIF_BYTES:
        raise BadNotification(f"notification of {len(raw)} bytes exceeds {MAX_NOTIF_BYTES}")
    tagged = _TAG_RE.search(raw) is not None
    if secret:
        if not tagged:
            raise UnauthenticatedNotification("notification without an HMAC tag (peer lacks the secret?)")
        body, tag = raw[:-_TAG_LEN], raw[-64:]
        if not hmac.compare_digest(tag, hmac.new(secret, body, hashlib.sha256).hexdigest().encode()):
            raise UnauthenticatedNotification("notification HMAC does not match (shared secrets differ)")
        raw = body
    elif tagged:
        raise UnauthenticatedNotification("notification carries an HMAC tag but no secret is configured here")
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
    if kind == "pushed" and rest and count == 0:
        return Pushed(rest)
    if kind == "cancelled":
        if not rest or count != 0:
            raise BadNotification(f"cancelled notification needs a request id: {text[:80]!r}")
        return Cancelled(rest)
    try:
        body = json.loads(rest)
    except ValueError:
        raise BadNotification(f"malformed {kind} notification body") from None
    if kind == "hb":
        if not (isinstance(body, list) and len(body) <= MAX_HEARTBEAT_IDS
                and all(isinstance(x, str) for x in body)):
            raise BadNotification("heartbeat must carry a list of request ids")
        return Heartbeat(tuple(body))
    if kind == "pushed":
        ids = body.get("remote_block_ids") if isinstance(body, dict) else None
        if not (isinstance(ids, list) and isinstance(body.get("request_id"), str)
                and all(isinstance(g, list) and all(type(b) is int and b >= 0 for b in g) for g in ids)):
            raise BadNotification("pushed notification must carry request_id and remote_block_ids")
        return Pushed(body["request_id"], tuple(tuple(g) for g in ids))
    if kind == "push":
        if not (isinstance(body, dict) and isinstance(body.get("request_id"), str)
                and isinstance(body.get("info"), dict)):
            raise BadNotification("push request must carry request_id and info")
        return PushRequest(body["request_id"], body["info"])
    if kind == "cancel":
        if not (isinstance(body, dict) and all(isinstance(body.get(k), str) and body[k]
                                               for k in ("request_id", "d_request_id", "d_engine_id"))
                and type(body.get("d_rank")) is int and body["d_rank"] >= 0):
            raise BadNotification("cancel must carry request_id, d_request_id, d_engine_id and d_rank")
        return Cancel(body["request_id"], body["d_request_id"], body["d_engine_id"], body["d_rank"])
    raise BadNotification(f"unknown notification kind {kind!r}")
