"""`kv_transfer_params` from clients and routers: anything malformed is refused with a message
naming the field, before it changes any state of the engine or of other requests."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink.connector.config import ConnectorConfig
from kvlink.connector.params import (
    MAX_BLOCK_ID,
    ForbiddenTransferParams,
    InvalidTransferParams,
    StaleTransferParams,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvlink.connector.scheduler import NixlScheduler
from kvlink.connector.secret import MIN_SECRET_BYTES, MissingSecret, load_secret
from kvlink.engine.engine import LLMEngine
from kvlink.engine.model.tiny_hybrid import TinyHybridModel
from kvlink.engine.request import SamplingParams

SECRET = b"a test secret of 32 bytes or so."
VALID: dict[str, Any] = {
    "do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r1",
    "remote_block_ids": [[1, 2, 3], [4]], "remote_host": "127.0.0.1", "remote_port": 5600,
    "tp_size": 1, "remote_num_tokens": 40,
}
REQUIRED = ["do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_block_ids",
            "remote_host", "remote_port", "tp_size"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_json_is_parsed_or_refused_cleanly(value: Any) -> None:
    try:
        parse_remote_prefill(value)
    except InvalidTransferParams as error:
        assert "kv_transfer_params" in str(error)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(VALID)), json_values)
def test_one_field_replaced_by_anything(field: str, value: Any) -> None:
    params = {**VALID, field: value}
    try:
        parsed = parse_remote_prefill(params)
    except InvalidTransferParams as error:
        assert field in str(error) or "kv_transfer_params" in str(error)
        return
    # Accepted: the value was of the right type and in range.
    assert getattr(parsed, field) is not None or field == "remote_num_tokens"


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_field_is_named(field: str) -> None:
    params = {k: v for k, v in VALID.items() if k != field}
    with pytest.raises(InvalidTransferParams, match=field):
        parse_remote_prefill(params)


@pytest.mark.parametrize(("field", "value", "named"), [
    ("remote_block_ids", [[-1, 2]], "invalid block ids"),
    ("remote_block_ids", [[MAX_BLOCK_ID]], "invalid block ids"),
    ("remote_block_ids", [[10**30]], "remote_block_ids"),
    ("remote_block_ids", [[1, 1]], "repeats a block id"),
    ("remote_block_ids", "1,2", "remote_block_ids"),
    ("remote_block_ids", [[True, 2]], "remote_block_ids"),
    ("remote_port", 0, "not a TCP port"),
    ("remote_port", 70000, "not a TCP port"),
    ("remote_port", "5600", "remote_port"),
    ("tp_size", 0, "tp_size"),
    ("tp_size", 1 << 20, "tp_size"),
    ("remote_num_tokens", -3, "remote_num_tokens"),
    ("kv_expires_at_ms", -1, "kv_expires_at_ms"),
    ("kv_expires_at_ms", 1.5, "kv_expires_at_ms"),
    ("transfer_mode", "teleport", "transfer_mode"),
    ("remote_engine_id", 5, "remote_engine_id"),
    ("do_remote_prefill", "yes", "do_remote_prefill"),
])
def test_bad_values_are_named(field: str, value: Any, named: str) -> None:
    with pytest.raises(InvalidTransferParams, match=named):
        parse_remote_prefill({**VALID, field: value})


def test_flags_must_be_booleans() -> None:
    with pytest.raises(InvalidTransferParams, match="do_remote_prefill"):
        wants_remote_prefill({"do_remote_prefill": 1})
    with pytest.raises(InvalidTransferParams, match="do_remote_decode"):
        wants_remote_decode({"do_remote_decode": "true"})
    assert not wants_remote_prefill(None) and not wants_remote_decode({})


# ---- through the engine: a refusal changes nothing -----------------------------------------
VOCAB, NUM_BLOCKS = 512, 16
PROMPT = [(7 * i + 3) % VOCAB for i in range(37)]


def _engine() -> LLMEngine:
    model = TinyHybridModel(vocab_size=VOCAB, seed=11, eos_token_ids=())
    scheduler = NixlScheduler(ConnectorConfig("D", side_channel_port=0, secret=SECRET), tp_size=1)
    return LLMEngine(model, NUM_BLOCKS, 8, 8, scheduler, None)


def _run(engine: LLMEngine, bad: list[Any]) -> list[int]:
    engine.add_request("good", PROMPT, SamplingParams(max_tokens=6))
    tokens: list[int] = []
    for k, params in enumerate(bad):
        tokens += [t for out in engine.step() for t in out.new_token_ids]
        with pytest.raises(ValueError, match="kv_transfer_params"):
            engine.add_request(f"bad{k}", PROMPT, SamplingParams(max_tokens=6), params)
        assert f"bad{k}" not in engine.requests
    for _ in range(50):
        for out in engine.step():
            tokens += out.new_token_ids
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "a refused request left work behind"
    assert engine.stats()["free_blocks"] == [NUM_BLOCKS] * len(engine.pools)
    engine.check_integrity()
    return tokens


BAD_PARAMS: list[Any] = [
    {**VALID, "remote_block_ids": [[-5]]},
    {**VALID, "remote_port": "x"},
    {"do_remote_prefill": True},
    {"do_remote_prefill": "yes"},
    {"do_remote_decode": 7},
    {**VALID, "tp_size": 0},
]


def test_refused_params_leave_the_engine_and_other_requests_untouched() -> None:
    reference = _run(_engine(), [])
    assert _run(_engine(), BAD_PARAMS) == reference
    engine = _engine()
    _run(engine, BAD_PARAMS)
    # The refused ids are free for a correct request afterwards.
    engine.add_request("bad0", PROMPT, SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()


# ---- params signed by P, bound to their prompt and to P's lease ----------------------------
class _View:
    def __init__(self, request_id: str, prompt: list[int], params: dict[str, Any] | None) -> None:
        self.request_id, self.prompt_token_ids, self.kv_transfer_params = request_id, prompt, params
        self.output_token_ids: list[int] = []


class WallClock:
    def __init__(self, now: float = 1.8e9) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


LEASE_S = 30.0


def _p_params(secret: bytes | None, prompt: list[int], clock: WallClock | None = None,
              incarnation: str | None = "inc1") -> dict[str, Any]:
    p = NixlScheduler(ConnectorConfig("P", side_channel_port=5600, secret=secret, lease_s=LEASE_S,
                                      insecure_unsigned_params=secret is None, incarnation=incarnation),
                      tp_size=1, wall_clock=clock or WallClock())
    held, params = p.request_finished(_View("p1", prompt, {"do_remote_decode": True}),  # type: ignore[arg-type]
                                      [[1, 2, 3], [4]], aborted=False)
    assert held and params is not None
    return params


def _d(secret: bytes | None, clock: WallClock | None = None, policy: str = "fail") -> NixlScheduler:
    return NixlScheduler(ConnectorConfig("D", side_channel_port=0, secret=secret,
                                         insecure_unsigned_params=secret is None,
                                         load_failure_policy=policy),  # type: ignore[arg-type]
                         tp_size=1, wall_clock=clock or WallClock())


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLINK_SECRET", raising=False)


def test_params_for_another_prompt_are_refused() -> None:
    params = _p_params(SECRET, PROMPT)
    _d(SECRET).on_new_request(_View("d1", PROMPT, params))  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferParams, match="another prompt"):
        _d(SECRET).on_new_request(_View("d2", [*PROMPT[:-1], 1], params))  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [
    ("remote_block_ids", [[7, 8, 9], [4]]),  # another request's blocks
    ("remote_engine_id", "P2"),
    ("remote_request_id", "p2"),
    ("remote_host", "127.0.0.2"),
    ("remote_port", 5700),
    ("tp_size", 2),
    ("transfer_mode", "push"),
    ("remote_incarnation", "inc0"),  # P's earlier start
    ("kv_expires_at_ms", 2**40),  # a lease that never ends
    ("prompt_hash", None),  # the prompt binding dropped
])
def test_altered_params_are_forbidden(field: str, value: Any) -> None:
    params = _p_params(SECRET, PROMPT)
    _d(SECRET).on_new_request(_View("d1", PROMPT, params))  # type: ignore[arg-type]
    d = _d(SECRET)
    with pytest.raises(ForbiddenTransferParams, match="kv_signature does not match"):
        d.on_new_request(_View("d2", PROMPT, {**params, field: value}))  # type: ignore[arg-type]
    with pytest.raises(ForbiddenTransferParams, match="no kv_signature"):
        unsigned = {k: v for k, v in params.items() if k != "kv_signature"}
        d.on_new_request(_View("d3", PROMPT, unsigned))  # type: ignore[arg-type]
    with pytest.raises(ForbiddenTransferParams, match="kv_signature does not match"):
        _d(b"another secret, also long enough").on_new_request(_View("d4", PROMPT, params))  # type: ignore[arg-type]
    with pytest.raises(ForbiddenTransferParams, match="kv_signature does not match"):
        d.on_new_request(_View("d5", PROMPT, {**params, "kv_signature": "é" * 64}))  # type: ignore[arg-type]
    assert not d.has_pending_work(), "a refused request left state behind"


def test_params_expire_with_the_lease_p_granted() -> None:
    clock = WallClock()
    params = _p_params(SECRET, PROMPT, clock)
    assert params["kv_expires_at_ms"] == int((clock.now + LEASE_S) * 1000)
    clock.now += LEASE_S - 0.5
    _d(SECRET, clock).on_new_request(_View("d1", PROMPT, params))  # type: ignore[arg-type]
    clock.now += 1.0
    d = _d(SECRET, clock)
    with pytest.raises(StaleTransferParams, match=r"expired 0\.5s ago"):
        d.on_new_request(_View("d2", PROMPT, params))  # type: ignore[arg-type]
    assert not d.has_pending_work()
    # Under load_failure_policy recompute D prefills it itself: no load, nothing read from P.
    lenient = _d(SECRET, clock, policy="recompute")
    view = _View("d3", PROMPT, params)
    lenient.on_new_request(view)  # type: ignore[arg-type]
    assert lenient.get_num_new_matched_tokens(view, 0) == (0, False)  # type: ignore[arg-type]
    assert not lenient.build_step_metadata().loads and not lenient.has_pending_work()


def test_params_serve_one_request_a_replay_reads_nothing() -> None:
    """P frees once D has read and may give the blocks to another request while the params
    still look valid: a second request with the same params, under any id, is refused like
    expired ones (recompute: prefilled here, nothing read), and the record goes when the
    lease ends."""
    clock = WallClock()
    params = _p_params(SECRET, PROMPT, clock)
    d = _d(SECRET, clock)
    first = _View("d1", PROMPT, params)
    d.on_new_request(first)  # type: ignore[arg-type]
    with pytest.raises(StaleTransferParams, match="already used by request 'd1'"):
        d.on_new_request(_View("d2", PROMPT, params))  # type: ignore[arg-type]
    # nor under the first request's id once it finished (a client may choose its X-Request-Id)
    with pytest.raises(StaleTransferParams, match="already used by request 'd1'"):
        d.on_new_request(_View("d1", PROMPT, params))  # type: ignore[arg-type]
    lenient = _d(SECRET, clock, policy="recompute")
    lenient.on_new_request(_View("a", PROMPT, params))  # type: ignore[arg-type]
    replay = _View("b", PROMPT, params)
    lenient.on_new_request(replay)  # type: ignore[arg-type]
    assert lenient.get_num_new_matched_tokens(replay, 0) == (0, False)  # type: ignore[arg-type]
    # other params of the same P request id (P issued them again) are another grant
    again = _p_params(SECRET, PROMPT, WallClock(clock.now + 1))
    d.on_new_request(_View("d3", PROMPT, again))  # type: ignore[arg-type]
    clock.now += LEASE_S + 2  # past the leases the record is dropped; the params are expired anyway
    with pytest.raises(StaleTransferParams, match="expired"):
        d.on_new_request(_View("d4", PROMPT, params))  # type: ignore[arg-type]
    d.on_new_request(_View("d5", PROMPT, _p_params(SECRET, PROMPT, clock)))  # type: ignore[arg-type]
    assert len(d._used) == 1  # the expired records went with the next grant


def test_the_replay_record_is_bounded() -> None:
    from kvlink.connector.params import RemotePrefillParams
    from kvlink.connector.replay import UsedParams

    used = UsedParams(capacity=3)
    grants = [RemotePrefillParams(do_remote_prefill=True, remote_engine_id="P", remote_request_id=f"r{i}",
                                  remote_block_ids=[[i]], remote_host="h", remote_port=1, tp_size=1,
                                  kv_expires_at_ms=10_000 + i) for i in range(5)]
    for i, grant in enumerate(grants):
        used.claim(grant, f"d{i}", now_s=1.0)
    assert len(used) == 3  # the two whose leases end first were forgotten
    with pytest.raises(StaleTransferParams):
        used.claim(grants[4], "d4", now_s=1.0)
    with pytest.raises(ValueError, match="capacity"):
        UsedParams(capacity=0)


def test_forged_params_are_refused_even_under_recompute() -> None:
    params = _p_params(SECRET, PROMPT)
    with pytest.raises(ForbiddenTransferParams, match="kv_signature does not match"):
        _d(SECRET, policy="recompute").on_new_request(  # type: ignore[arg-type]
            _View("d1", PROMPT, {**params, "remote_block_ids": [[9, 10, 11], [4]]}))


def test_signed_params_without_an_expiry_are_forbidden() -> None:
    from kvlink.connector.params import sign

    params = {k: v for k, v in _p_params(SECRET, PROMPT).items() if k != "kv_expires_at_ms"}
    params["kv_signature"] = sign(params, SECRET)
    with pytest.raises(ForbiddenTransferParams, match="no kv_expires_at_ms"):
        _d(SECRET).on_new_request(_View("d1", PROMPT, params))  # type: ignore[arg-type]


def test_no_secret_and_no_opt_out_refuses_to_build_a_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    for engine_id in ("P", "D"):
        with pytest.raises(MissingSecret, match=r"KVLINK_SECRET.*--secret-file.*--insecure-unsigned-params"):
            NixlScheduler(ConnectorConfig(engine_id), tp_size=1)
    # The opt-out: unsigned params are made and accepted (the old, unsafe behaviour).
    params = _p_params(None, PROMPT)
    assert "kv_signature" not in params
    _d(None).on_new_request(_View("d1", PROMPT, params))  # type: ignore[arg-type]
    # $KVLINK_SECRET counts as configured.
    monkeypatch.setenv("KVLINK_SECRET", SECRET.decode())
    env_d = NixlScheduler(ConnectorConfig("D"), tp_size=1)
    with pytest.raises(ForbiddenTransferParams, match="no kv_signature"):
        env_d.on_new_request(_View("d2", PROMPT, params))  # type: ignore[arg-type]
    env_d.on_new_request(_View("d3", PROMPT, _p_params(SECRET, PROMPT)))  # type: ignore[arg-type]


def test_load_secret_from_file_or_env(tmp_path: Any) -> None:
    good = tmp_path / "secret"
    good.write_text("s" * MIN_SECRET_BYTES + "\n")
    assert load_secret(good, environ={}) == b"s" * MIN_SECRET_BYTES
    assert load_secret(good, environ={"KVLINK_SECRET": "e" * 20}) == b"s" * MIN_SECRET_BYTES
    assert load_secret(None, environ={"KVLINK_SECRET": "e" * 20}) == b"e" * 20
    assert load_secret(None, environ={}) is None
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(ValueError, match=re.escape(f"--secret-file {short} holds a secret of 3 bytes; it "
                                                   f"must be at least {MIN_SECRET_BYTES} bytes")):
        load_secret(short, environ={})
    with pytest.raises(ValueError, match="KVLINK_SECRET holds a secret of 5 bytes"):
        load_secret(None, environ={"KVLINK_SECRET": "short"})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_secret(empty, environ={})
    with pytest.raises(ValueError, match="cannot read it"):
        load_secret(tmp_path / "missing", environ={})
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe" * 16)
    with pytest.raises(ValueError, match="not UTF-8 text"):
        load_secret(binary, environ={})


def test_a_field_left_out_is_signed_as_its_default() -> None:
    """A router that drops a field D would default anyway changes nothing D acts on; dropping
    one whose value was not the default is an alteration."""
    params = _p_params(SECRET, PROMPT)
    assert params["transfer_mode"] == "pull"
    _d(SECRET).on_new_request(_View("d1", PROMPT, {k: v for k, v in params.items() if k != "transfer_mode"}))  # type: ignore[arg-type]
    push = NixlScheduler(ConnectorConfig("P", secret=SECRET, transfer_mode="push"), tp_size=1, wall_clock=WallClock())
    _, pushed = push.request_finished(_View("p2", PROMPT, {"do_remote_decode": True}), [[1], [2]], aborted=False)  # type: ignore[arg-type]
    assert pushed is not None
    with pytest.raises(ForbiddenTransferParams, match="kv_signature does not match"):
        _d(SECRET).on_new_request(_View("d2", PROMPT, {k: v for k, v in pushed.items() if k != "transfer_mode"}))  # type: ignore[arg-type]


def test_layerwise_params_name_no_p_blocks() -> None:
    """D-side layerwise params come from the proxy before P allocated anything."""
    from kvlink.connector.params import InvalidTransferParams, is_layerwise, parse_remote_prefill

    base = {"do_remote_prefill": True, "transfer_mode": "layerwise", "remote_engine_id": "P",
            "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
    assert is_layerwise(parse_remote_prefill(base))
    with pytest.raises(InvalidTransferParams, match="name no remote_block_ids"):
        parse_remote_prefill({**base, "remote_block_ids": [[1, 2]]})
    with pytest.raises(InvalidTransferParams, match="must be one of pull, push, layerwise"):
        parse_remote_prefill({**base, "transfer_mode": "stream", "remote_block_ids": [[1]]})


@pytest.mark.parametrize(("field", "value"), [("remote_engine_id", "E" * 257), ("remote_engine_id", "a\nb"),
                                              ("remote_engine_id", ""), ("remote_host", "h" * 300)])
def test_engine_ids_and_hosts_are_bounded(field: str, value: str) -> None:
    """An engine id becomes a metrics label and a log word: at most 256 printable characters
    (a 200,000-character id in forged layerwise params grew D's /metrics by 900 KB)."""
    for mode in ("pull", "layerwise"):
        params = {**VALID, "transfer_mode": mode, field: value}
        if mode == "layerwise":
            params.pop("remote_block_ids")
        with pytest.raises(InvalidTransferParams, match=f"{field} must be 1 to 256 printable"):
            parse_remote_prefill(params)
