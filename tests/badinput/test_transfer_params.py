"""`kv_transfer_params` from clients and routers: anything malformed is refused with a message
naming the field, before it changes any state of the engine or of other requests."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink.connector.config import ConnectorConfig
from kvlink.connector.params import (
    MAX_BLOCK_ID,
    InvalidTransferParams,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvlink.connector.scheduler import NixlScheduler
from kvlink.engine.engine import LLMEngine
from kvlink.engine.model.tiny_hybrid import TinyHybridModel
from kvlink.engine.request import SamplingParams

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
    scheduler = NixlScheduler(ConnectorConfig("D", side_channel_port=0), tp_size=1)
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


# ---- params bound to their prompt, and signed with the shared secret -----------------------
class _View:
    def __init__(self, request_id: str, prompt: list[int], params: dict[str, Any] | None) -> None:
        self.request_id, self.prompt_token_ids, self.kv_transfer_params = request_id, prompt, params
        self.output_token_ids: list[int] = []


def _p_params(secret: bytes | None, prompt: list[int]) -> dict[str, Any]:
    p = NixlScheduler(ConnectorConfig("P", side_channel_port=5600, secret=secret), tp_size=1)
    held, params = p.request_finished(_View("p1", prompt, {"do_remote_decode": True}),  # type: ignore[arg-type]
                                      [[1, 2, 3], [4]], aborted=False)
    assert held and params is not None
    return params


def _d(secret: bytes | None) -> NixlScheduler:
    return NixlScheduler(ConnectorConfig("D", side_channel_port=0, secret=secret), tp_size=1)


def test_params_for_another_prompt_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLINK_SECRET", raising=False)
    params = _p_params(None, PROMPT)
    _d(None).on_new_request(_View("d1", PROMPT, params))  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferParams, match="another prompt"):
        _d(None).on_new_request(_View("d2", [*PROMPT[:-1], 1], params))  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [
    ("remote_block_ids", [[7, 8, 9], [4]]),  # another request's blocks
    ("remote_engine_id", "P2"),
    ("remote_request_id", "p2"),
    ("remote_port", 5700),
])
def test_with_a_secret_altered_params_are_refused(monkeypatch: pytest.MonkeyPatch, field: str, value: Any) -> None:
    monkeypatch.delenv("KVLINK_SECRET", raising=False)
    secret = b"shared"
    params = _p_params(secret, PROMPT)
    _d(secret).on_new_request(_View("d1", PROMPT, params))  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferParams, match="kv_signature does not match"):
        _d(secret).on_new_request(_View("d2", PROMPT, {**params, field: value}))  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferParams, match="no kv_signature"):
        unsigned = {k: v for k, v in params.items() if k != "kv_signature"}
        _d(secret).on_new_request(_View("d3", PROMPT, unsigned))  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferParams, match="kv_signature does not match"):
        _d(b"other").on_new_request(_View("d4", PROMPT, params))  # type: ignore[arg-type]
