"""Typed msgpack messages of the side-channel handshake; decoding is strict and size-limited."""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class WireError(ValueError):
    """A message that is too large, undecodable, of the wrong type or version."""


class HandshakeRequest(msgspec.Struct, frozen=True, tag="request", forbid_unknown_fields=True):
    """D asks P's listener for the payload of one of P's TP ranks."""

    version: int
    engine_id: str
    tp_rank: int


class HandshakePayload(msgspec.Struct, frozen=True, tag="payload", forbid_unknown_fields=True):
    """What one P rank publishes: its NIXL agent metadata and its KV geometry.

    ``geometry`` is produced and checked by the layout layer; here it is bytes.
    ``sent_time`` is the listener's ``time.time()`` when it answered.
    """

    version: int
    engine_id: str
    tp_rank: int
    tp_size: int
    compat_hash: str
    agent_name: str
    agent_metadata: bytes
    geometry: bytes
    sent_time: float
    # Address of the rank's KV digest table (kvlink.connector.digest_table), laid out from its
    # geometry; 0: it keeps none (verify_kv off).
    digest_table: int = 0
    # Staging areas a reader rank offers writers whose pages it must re-lay out (layerwise
    # between kernel block sizes, kvlink.plan.staged): (P kernel block size, pages per layer,
    # base address of each attention layer's pages).
    staging: tuple[tuple[int, int, tuple[int, ...]], ...] = ()


class HandshakeError(msgspec.Struct, frozen=True, tag="error", forbid_unknown_fields=True):
    """The listener's refusal, with a message meant for the operator."""

    message: str


class _VersionProbe(msgspec.Struct):
    """Reads only ``version``, so a peer of another version gets a clear answer."""

    version: int


Reply = HandshakePayload | HandshakeError

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_probe_decoder = msgspec.msgpack.Decoder(_VersionProbe)


def encode(message: HandshakeRequest | HandshakePayload | HandshakeError) -> bytes:
    body = _encoder.encode(message)
    _check_size(body)
    return body


def _check_size(body: bytes) -> None:
    if len(body) > MAX_MESSAGE_BYTES:
        raise WireError(
            f"message of {len(body)} bytes exceeds MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}"
        )


def peek_version(body: bytes) -> int:
    """The ``version`` field of any of our messages, or WireError."""
    _check_size(body)
    try:
        return _probe_decoder.decode(body).version
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable message: {exc}") from exc


def decode_request(body: bytes) -> HandshakeRequest:
    _check_size(body)
    try:
        return _request_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise WireError(f"not a valid HandshakeRequest: {exc}") from exc


def decode_reply(body: bytes) -> HandshakePayload | HandshakeError:
    _check_size(body)
    try:
        return _reply_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise WireError(f"not a valid handshake reply: {exc}") from exc
