"""Handshake wire structs: round trips, strict typing, size limit, version probing."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink.transfer import wire
from kvlink.transfer.wire import HandshakeError, HandshakePayload, HandshakeRequest


def payload(**overrides: object) -> HandshakePayload:
    fields: dict[str, object] = dict(
        version=wire.PROTOCOL_VERSION, engine_id="p0", tp_rank=1, tp_size=2, compat_hash="abc",
        agent_name="prefill-1", agent_metadata=b"\x00md", geometry=b"\x81\xa1k\x01", sent_time=1.5,
    )  # fmt: skip
    fields.update(overrides)
    return HandshakePayload(**fields)  # type: ignore[arg-type]


def test_round_trips() -> None:
    request = HandshakeRequest(wire.PROTOCOL_VERSION, "p0", 3)
    assert wire.decode_request(wire.encode(request)) == request
    assert wire.decode_reply(wire.encode(payload())) == payload()
    assert wire.decode_reply(wire.encode(HandshakeError("no"))) == HandshakeError("no")
    assert wire.peek_version(wire.encode(payload(version=7))) == 7


def test_wrong_types_and_shapes_are_refused() -> None:
    with pytest.raises(wire.WireError):
        wire.decode_request(wire.encode(payload()))  # a payload is not a request
    bad_rank = msgspec.msgpack.encode(
        {"type": "request", "version": 1, "engine_id": "p", "tp_rank": "0"}
    )
    with pytest.raises(wire.WireError, match="tp_rank"):
        wire.decode_request(bad_rank)
    extra = msgspec.msgpack.encode(
        {"type": "request", "version": 1, "engine_id": "p", "tp_rank": 0, "evil": 1}
    )
    with pytest.raises(wire.WireError, match="evil"):
        wire.decode_request(extra)
    with pytest.raises(wire.WireError):
        wire.peek_version(wire.encode(HandshakeError("no version field")))


def test_size_limit_applies_before_decoding() -> None:
    huge = payload(agent_metadata=b"x" * wire.MAX_MESSAGE_BYTES)
    with pytest.raises(wire.WireError, match="MAX_MESSAGE_BYTES"):
        wire.encode(huge)
    with pytest.raises(wire.WireError, match="MAX_MESSAGE_BYTES"):
        wire.decode_reply(b"\x00" * (wire.MAX_MESSAGE_BYTES + 1))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_fail_only_with_wire_error(body: bytes) -> None:
    try:
        request = wire.decode_request(body)
    except wire.WireError:
        return
    assert isinstance(request, HandshakeRequest)  # no other exception type escapes
