"""Notification messages round-trip, and anything else is refused with BadNotification."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlink.connector.notifs import (
    BadNotification,
    Cancel,
    Cancelled,
    Done,
    Heartbeat,
    Pushed,
    PushRequest,
    decode,
    encode,
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
