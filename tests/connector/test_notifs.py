"""Notification messages round-trip, and anything else is refused with BadNotification."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlink.connector.notifs import (
    MAX_HEARTBEAT_IDS,
    MAX_NOTIF_BYTES,
    BadNotification,
    Cancel,
    Cancelled,
    Done,
    Heartbeat,
    Pushed,
    PushRequest,
    decode,
    encode,
    encode_heartbeats,
)

ids = st.text(min_size=1, max_size=40)


@given(ids, st.integers(1, 64))
def test_done_round_trips(rid: str, expected: int) -> None:
    assert decode(encode(Done(rid, expected))) == Done(rid, expected)


@given(st.lists(ids, max_size=20))
def test_heartbeat_round_trips(rids: list[str]) -> None:
    assert decode(encode(Heartbeat(tuple(rids)))) == Heartbeat(tuple(rids))


def test_push_messages_round_trip() -> None:
    msg = PushRequest("r:1", {"blocks": [[1, 2]], "host": "127.0.0.1"})
    assert decode(encode(msg)) == msg
    assert decode(encode(Pushed("d:9"))) == Pushed("d:9")
    named = Pushed("d:9", ((3, 1, 4), (7,)))  # layerwise: P names its blocks
    assert decode(encode(named, b"s"), b"s") == named


@given(ids, ids, ids, st.integers(0, 1024))
def test_cancel_messages_round_trip(rid: str, d_rid: str, engine: str, rank: int) -> None:
    assert decode(encode(Cancel(rid, d_rid, engine, rank), b"s"), b"s") == Cancel(rid, d_rid, engine, rank)
    assert decode(encode(Cancelled(d_rid))) == Cancelled(d_rid)


@pytest.mark.parametrize("raw", [b"kvlink1:cancelled:0:", b"kvlink1:cancelled:1:r", b"kvlink1:cancel:0:[]",
                                 b'kvlink1:cancel:0:{"request_id":"r","d_request_id":"d","d_engine_id":"D"}',
                                 b'kvlink1:cancel:0:{"request_id":"r","d_request_id":"d","d_engine_id":"D","d_rank":-1}',
                                 b'kvlink1:cancel:0:{"request_id":"","d_request_id":"d","d_engine_id":"D","d_rank":0}',
                                 b'kvlink1:cancel:0:{"request_id":"r","d_request_id":"d","d_engine_id":"D","d_rank":true}'])
def test_bad_cancels_are_refused(raw: bytes) -> None:
    with pytest.raises(BadNotification):
        decode(raw)


@pytest.mark.parametrize("body", [b"[]", b'{"request_id":"r"}', b'{"request_id":"r","remote_block_ids":[[-1]]}',
                                  b'{"request_id":"r","remote_block_ids":[["1"]]}', b'{"remote_block_ids":[]}'])
def test_bad_pushed_block_lists_are_refused(body: bytes) -> None:
    with pytest.raises(BadNotification):
        decode(b"kvlink1:pushed:1:" + body)


@pytest.mark.parametrize(
    "raw",
    [b"", b"hello", b"kvlink1:done:0:r", b"kvlink1:done:x:r", b"kvlink2:done:1:r",
     b"kvlink1:hb:1:{}", b"kvlink1:hb:1:[1]", b"kvlink1:push:0:[]", b"kvlink1:what:0:x",
     b"\xff\xfe", b"kvlink1:done:1:" + b"x" * 70000],
)
def test_garbage_is_refused(raw: bytes) -> None:
    with pytest.raises(BadNotification):
        decode(raw)


@given(st.binary(max_size=200))
def test_random_bytes_never_crash(raw: bytes) -> None:
    with contextlib.suppress(BadNotification):
        decode(raw)


@pytest.mark.parametrize("secret", [None, b"s" * 32])
@pytest.mark.parametrize(("count", "length"), [(1, 10), (5000, 16), (300, 8000), (3, 70000), (10000, 256)])
def test_heartbeats_split_to_what_decode_takes(secret: bytes | None, count: int, length: int) -> None:
    """D waiting on many (or long-named) requests from one P: every id that fits a message is
    named in some heartbeat, and each heartbeat decodes (one over the limits would be dropped
    whole, and P would let every lease in it run out)."""
    ids = [f"{i:08d}" + "x" * (length - 8) for i in range(count)]
    beats = encode_heartbeats(ids, secret)
    named: list[str] = []
    for raw in beats:
        assert len(raw) <= MAX_NOTIF_BYTES
        msg = decode(raw, secret)
        assert isinstance(msg, Heartbeat)
        named += msg.request_ids
    fits = [rid for rid in ids if len(rid) < MAX_NOTIF_BYTES - 200]
    assert named == fits
    if fits:  # no more messages than it takes
        assert len(beats) <= 1 + max(-(-len(fits) // MAX_HEARTBEAT_IDS),
                                     -(-sum(len(r) + 3 for r in fits) // MAX_NOTIF_BYTES))


def test_heartbeat_of_no_ids_is_no_message() -> None:
    assert encode_heartbeats([]) == []
