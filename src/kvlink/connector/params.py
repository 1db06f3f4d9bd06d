"""`kv_transfer_params`: the fields routers pass between P and D, validated before use.

Field names follow vLLM's NixlConnector so existing routers work unchanged. P adds fields
of its own: `prompt_hash` (D refuses params made for another prompt: a router that mixed
up two requests would otherwise decode from the wrong KV), `kv_expires_at_ms` (when P's
lease on the blocks ends if no decoder claims them: later, they may hold another request's
KV) and `kv_signature`, an HMAC with the shared secret over everything D acts on, so a
client that can reach D cannot point it at blocks of another request or another engine.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import Any

import msgspec

from kvlink.connector.notifs import MAX_REQUEST_ID_BYTES

MAX_BLOCK_ID = 1 << 40
NULL_BLOCK_ID = 0  # a placeholder that may repeat in a block list (see parse_remote_prefill)


class InvalidTransferParams(ValueError):
    """A client or router sent `kv_transfer_params` we cannot use; the message says why."""


class ForbiddenTransferParams(InvalidTransferParams):
    """Params that do not prove P made them for this request now: unsigned, altered, expired,
    or from an earlier start of P. Nothing is read with them (HTTP 403)."""


class StaleTransferParams(ForbiddenTransferParams):
    """Signed by P, but expired: P's lease on the blocks is over, they may be reused."""


class RemotePrefillParams(msgspec.Struct, forbid_unknown_fields=False):
    """What D needs to pull a request's KV from P (P's answer, forwarded by the proxy)."""

    do_remote_prefill: bool
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[list[int]]
    remote_host: str
    remote_port: int
    tp_size: int
    remote_num_tokens: int | None = None
    transfer_mode: str = "pull"
    do_remote_decode: bool = False
    prompt_hash: str | None = None
    kv_signature: str | None = None
    remote_incarnation: str | None = None
    kv_expires_at_ms: int | None = None  # Unix time in ms on P's clock: end of P's lease


TRANSFER_MODES = ("pull", "push", "layerwise")
# An engine id names P in D's metrics labels and logs; a host name is at most 253 characters.
MAX_ENGINE_ID_CHARS = 256


def is_engine_name(value: str) -> bool:
    """An engine id or host a decoder takes in P's params: 1 to 256 printable characters."""
    return 0 < len(value) <= MAX_ENGINE_ID_CHARS and value.isprintable()


def _normalize_block_ids(raw: Any) -> Any:
    """Accept one flat list (single group, as vLLM sends without HMA) or a list per group."""
    if isinstance(raw, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        return [raw]
    return raw


def parse_remote_prefill(params: dict[str, Any]) -> RemotePrefillParams:
    """Validate D-side params; raise InvalidTransferParams naming the bad field."""
    if not isinstance(params, dict):
        raise InvalidTransferParams(f"kv_transfer_params must be an object, got {type(params).__name__}")
    data = dict(params)
    if data.get("transfer_mode") == "layerwise":
        data.setdefault("remote_block_ids", [])
    if "remote_block_ids" in data:
        data["remote_block_ids"] = _normalize_block_ids(data["remote_block_ids"])
    try:
        parsed = msgspec.convert(data, RemotePrefillParams, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidTransferParams(f"invalid kv_transfer_params: {exc}") from None
    if parsed.transfer_mode not in TRANSFER_MODES:
        raise InvalidTransferParams(
            f"kv_transfer_params.transfer_mode must be one of {', '.join(TRANSFER_MODES)}, "
            f"got {parsed.transfer_mode!r}"
        )
    if parsed.transfer_mode == "layerwise" and any(parsed.remote_block_ids):
        raise InvalidTransferParams("layerwise kv_transfer_params name no remote_block_ids: P has not "
                                    "allocated them yet, it writes into D's blocks as it prefills")
    if not parsed.remote_request_id or len(parsed.remote_request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise InvalidTransferParams(f"kv_transfer_params.remote_request_id must be 1 to {MAX_REQUEST_ID_BYTES} "
                                    f"bytes, got {len(parsed.remote_request_id.encode())}")
    for name in ("remote_engine_id", "remote_host"):
        value = getattr(parsed, name)
        if not is_engine_name(value):
            raise InvalidTransferParams(f"kv_transfer_params.{name} must be 1 to {MAX_ENGINE_ID_CHARS} "
                                        f"printable characters, got {len(value)}")
    if not 0 < parsed.remote_port < 65536:
        raise InvalidTransferParams(f"kv_transfer_params.remote_port {parsed.remote_port} is not a TCP port")
    if not 0 < parsed.tp_size <= 1024:
        raise InvalidTransferParams(f"kv_transfer_params.tp_size {parsed.tp_size} is out of range")
    for group, ids in enumerate(parsed.remote_block_ids):
        bad = [b for b in ids if not 0 <= b < MAX_BLOCK_ID]
        if bad:
            raise InvalidTransferParams(
                f"kv_transfer_params.remote_block_ids[{group}] has invalid block ids {bad[:5]}"
            )
        # Engines may list one placeholder block for the blocks a group no longer holds (vLLM's
        # null block 0: a sliding window's blocks behind the window); any other id is one block.
        held = [b for b in ids if b != NULL_BLOCK_ID]
        if len(set(held)) != len(held):
            raise InvalidTransferParams(f"kv_transfer_params.remote_block_ids[{group}] repeats a block id")
    if parsed.kv_expires_at_ms is not None and parsed.kv_expires_at_ms < 0:
        raise InvalidTransferParams("kv_transfer_params.kv_expires_at_ms must be >= 0")
    if parsed.remote_num_tokens is not None and parsed.remote_num_tokens < 0:
        raise InvalidTransferParams("kv_transfer_params.remote_num_tokens must be >= 0")
    return parsed


def prompt_hash(prompt_token_ids: Sequence[int]) -> str:
    """A short digest of the prompt P prefilled; D compares it with its own prompt."""
    data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in prompt_token_ids)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


_SIGNED_FIELDS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
                  "remote_port", "tp_size", "transfer_mode", "prompt_hash", "remote_incarnation",
                  "kv_expires_at_ms")
# Handshake frames and notifications are MACed with the same secret: a prefix of its own
# keeps one kind of message from ever passing as another.
_SIGNATURE_DOMAIN = b"kvlink kv_transfer_params v1\n"
# A field left out is signed as its default, the value D parses it as.
_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(RemotePrefillParams)
             if f.default is not msgspec.NODEFAULT}


def sign(params: dict[str, Any], secret: bytes) -> str:
    body = json.dumps([params.get(k, _DEFAULTS.get(k)) for k in _SIGNED_FIELDS], separators=(",", ":"))
    return hmac.new(secret, _SIGNATURE_DOMAIN + body.encode(), hashlib.sha256).hexdigest()


def check_integrity(parsed: RemotePrefillParams, prompt_token_ids: Sequence[int] | None,
                    secret: bytes | None, now_s: float) -> None:
    """Refuse params P did not sign with `secret` (None: the operator opted out of signing),
    params whose lease ended before `now_s` (Unix time), and params made for another prompt
    (not checked when `prompt_token_ids` is None: a request that will never run)."""
    if secret is not None:
        if parsed.kv_signature is None:
            raise ForbiddenTransferParams(
                "kv_transfer_params carry no kv_signature, but this instance only accepts params "
                "signed by a prefill instance sharing its secret; send the params P returned, unchanged")
        fields = msgspec.structs.asdict(parsed)
        if not hmac.compare_digest(parsed.kv_signature.encode(), sign(fields, secret).encode()):
            raise ForbiddenTransferParams(
                "kv_transfer_params.kv_signature does not match: the params were altered, or the "
                "prefill instance uses another secret; send the params P returned, unchanged")
        if parsed.kv_expires_at_ms is None:
            raise ForbiddenTransferParams(
                "kv_transfer_params carry no kv_expires_at_ms; signed params must say when P's "
                "lease on the blocks ends")
    if parsed.kv_expires_at_ms is not None and now_s * 1000 > parsed.kv_expires_at_ms:
        late_s = now_s - parsed.kv_expires_at_ms / 1000
        raise StaleTransferParams(
            f"kv_transfer_params expired {late_s:.1f}s ago (kv_expires_at_ms "
            f"{parsed.kv_expires_at_ms}): the prefill instance's lease on these blocks is over and "
            "they may hold another request's KV now; send the request through the prefill "
            "instance again (and check that P's and D's clocks agree)")
    if (prompt_token_ids is not None and parsed.prompt_hash is not None
            and parsed.prompt_hash != prompt_hash(prompt_token_ids)):
        raise InvalidTransferParams(
            "kv_transfer_params were made by the prefill instance for another prompt "
            "(prompt_hash differs); send each request's own params with the same prompt")


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """P side: the proxy asked us to prefill for a remote decoder."""
    if not params:
        return False
    flag = params.get("do_remote_decode", False)
    if not isinstance(flag, bool):
        raise InvalidTransferParams("kv_transfer_params.do_remote_decode must be a boolean")
    requested_mode(params)
    return flag


def requested_mode(params: dict[str, Any] | None) -> str | None:
    """P side: the transfer mode a router asked for this request ("pull", "push" or
    "layerwise"), if any."""
    mode = (params or {}).get("transfer_mode")
    if mode is not None and mode not in TRANSFER_MODES:
        raise InvalidTransferParams(f"kv_transfer_params.transfer_mode must be one of "
                                    f"{', '.join(TRANSFER_MODES)}, got {mode!r}")
    return mode


def is_layerwise(params: RemotePrefillParams) -> bool:
    """D side: P streams this request's KV into our blocks while it prefills; the params come
    from the proxy, not from P (nothing to verify yet: P checks our signed push request and
    the prompt's hash before it writes)."""
    return params.transfer_mode == "layerwise"


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """D side: this request's prompt KV lives on a remote prefill engine."""
    if not params:
        return False
    flag = params.get("do_remote_prefill", False)
    if not isinstance(flag, bool):
        raise InvalidTransferParams("kv_transfer_params.do_remote_prefill must be a boolean")
    return flag
