"""The scheduler-side adapter on stand-in vLLM requests (no engine): hybrid P stops one short."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvlink.connector.config import ConnectorConfig
from kvlink.integrations.vllm.layout import GroupInfo, model_spec
from kvlink.integrations.vllm.scheduler_side import SchedulerSide

MAMBA = GroupInfo("mamba2", ("model.layers.0.mixer",), "float32", conv_shape=(288, 3), state_shape=(4, 64, 16),
                  page_bytes=19840, page_stride=65536)
ATTENTION = GroupInfo("attention", ("model.layers.1.self_attn.attn",), "float32", num_kv_heads=1, head_dim=64,
                      block_size=128)


def side(groups: list[GroupInfo]) -> SchedulerSide:
    model = model_spec("m", groups, 1)
    return SchedulerSide(ConnectorConfig(engine_id="p", insecure_unsigned_params=True), 1, model,
                         tuple(range(len(groups))))


def request(prompt: list[int], params: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(request_id="r1", prompt_token_ids=list(prompt), _all_token_ids=list(prompt),
                           num_prompt_tokens=len(prompt), max_tokens=8, kv_transfer_params=params,
                           abort_immediately=False, status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))


def test_hybrid_p_computes_all_but_the_last_prompt_token_and_offers_n_minus_1() -> None:
    s, r = side([MAMBA, ATTENTION]), request([5, 6, 7, 8], {"do_remote_decode": True})
    s.on_new_request(r)
    assert r.prompt_token_ids == [5, 6, 7] and r._all_token_ids == [5, 6, 7]
    assert (r.num_prompt_tokens, r.max_tokens) == (3, 1)
    keep, params = s.request_finished(r, [[3], [1]])
    assert keep and params is not None
    assert params["remote_num_tokens"] == 3 and params["remote_block_ids"] == [[3], [1]]
    from kvlink.connector.params import prompt_hash
    assert params["prompt_hash"] == prompt_hash([5, 6, 7, 8])  # D checks against its full prompt


def test_p_seals_the_tokens_it_computed_and_d_checks_the_same_ones() -> None:
    """The digests' seeds chain over the shipped tokens: a hybrid P's save names its first N-1
    prompt tokens (the full prompt but the last, not its shortened one's N-2), and D's load the
    same N-1 of its own full prompt."""
    p, r = side([MAMBA, ATTENTION]), request([5, 6, 7, 8], {"do_remote_decode": True})
    p.on_new_request(r)
    _, params = p.request_finished(r, [[3], [1]])
    (save,) = p.build_step().saves
    assert (save["token_ids"], save["num_tokens"]) == ([5, 6, 7], 3)
    assert params is not None
    d, wanted = side([MAMBA, ATTENTION]), request([5, 6, 7, 8], params)
    d.on_new_request(wanted)
    assert d.get_num_new_matched_tokens(wanted, 0) == (3, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([7], [9]))
    d.update_state_after_alloc(wanted, blocks, 3)
    (load,) = d.build_step().loads
    assert (load["token_ids"], load["num_tokens"]) == ([5, 6, 7], 3)


def test_attention_only_p_and_plain_requests_are_untouched() -> None:
    r = request([5, 6, 7, 8], {"do_remote_decode": True})
    side([ATTENTION]).on_new_request(r)
    assert r.prompt_token_ids == [5, 6, 7, 8] and r.max_tokens == 8
    plain = request([5, 6, 7, 8], None)
    side([MAMBA, ATTENTION]).on_new_request(plain)
    assert plain.prompt_token_ids == [5, 6, 7, 8]


def _output(new: list[Any] = (), cached: SimpleNamespace | None = None,  # type: ignore[assignment]
            scheduled: dict[str, int] | None = None) -> SimpleNamespace:
    empty = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or empty,
                           num_scheduled_tokens=scheduled or {})


def test_p_names_the_requests_whose_prefill_a_step_completes_for_sealing_after_its_forward() -> None:
    """A one-token P request in chunks: no seal while chunks remain; the step that schedules
    the last chunk names it, with every block so far and the tokens its save will carry."""
    s = side([ATTENTION])
    r = request(list(range(300)), {"do_remote_decode": True})
    r.max_tokens = 1
    s.on_new_request(r)
    first = SimpleNamespace(req_id="r1", block_ids=([4, 5],), num_computed_tokens=128)
    assert s.build_step(_output([first], scheduled={"r1": 128})).seals == []
    chunk = SimpleNamespace(req_ids=["r1"], resumed_req_ids=set(), new_block_ids=[([9],)],
                            num_computed_tokens=[256])
    (seal,) = s.build_step(_output(cached=chunk, scheduled={"r1": 44})).seals
    assert seal["block_ids"] == [[4, 5, 9]] and seal["num_tokens"] == 299
    assert seal["token_ids"] == list(range(299))
    _, _ = s.request_finished(r, [[4, 5, 9]])
    (save,) = s.build_step().saves
    assert (save["block_ids"], save["token_ids"], save["num_tokens"]) == (
        seal["block_ids"], seal["token_ids"], seal["num_tokens"])
    assert s.build_step(_output(cached=chunk, scheduled={"r1": 44})).seals == []  # once


def test_requests_that_go_on_after_the_prefill_are_sealed_when_they_finish() -> None:
    """Several output tokens (their KV keeps changing the last page), no P/D params, or
    verify_kv off: nothing is sealed early."""
    many = request([1, 2, 3], {"do_remote_decode": True})
    plain = request([1, 2, 3], None)
    plain.request_id = "r2"
    plain.max_tokens = 1
    s = side([ATTENTION])
    s.on_new_request(many)
    s.on_new_request(plain)
    new = [SimpleNamespace(req_id=rid, block_ids=([1],), num_computed_tokens=0) for rid in ("r1", "r2")]
    assert s.build_step(_output(new, scheduled={"r1": 3, "r2": 3})).seals == []
    off = SchedulerSide(ConnectorConfig(engine_id="p", insecure_unsigned_params=True, verify_kv="off"), 1,
                        model_spec("m", [ATTENTION], 1), (0,))
    one = request([1, 2, 3], {"do_remote_decode": True})
    one.max_tokens = 1
    off.on_new_request(one)
    assert off.build_step(_output(new[:1], scheduled={"r1": 3})).seals == []


def test_layerwise_p_names_each_step_s_stream_requests_with_their_blocks_and_end() -> None:
    """P in layerwise mode: every step that computes a stream request tells the workers its
    block ids so far and how many tokens exist once the forward ends (chunk by chunk)."""
    s = side([ATTENTION])
    r = request(list(range(300)), {"do_remote_decode": True, "transfer_mode": "layerwise", "layerwise_id": "k1"})
    r.max_tokens = 1
    s.on_new_request(r)
    first_step = s.build_step(_output([SimpleNamespace(req_id="r1", block_ids=([4, 5],), num_computed_tokens=0)],
                                      scheduled={"r1": 256}))
    assert first_step.streams == [{"request_id": "r1", "prompt_hash": first_step.streams[0]["prompt_hash"],
                                   "num_tokens": 299, "key": "k1"}]
    assert first_step.layer_progress == [{"request_id": "r1", "block_ids": [[4, 5]], "end": 256}]
    chunk = SimpleNamespace(req_ids=["r1"], resumed_req_ids=set(), new_block_ids=[([9],)], num_computed_tokens=[256])
    assert s.build_step(_output(cached=chunk, scheduled={"r1": 44})).layer_progress == [
        {"request_id": "r1", "block_ids": [[4, 5, 9]], "end": 300}]
    s.request_finished(r, [[4, 5, 9]])
    assert s.build_step(_output(cached=chunk, scheduled={"r1": 44})).layer_progress == []


def test_layerwise_hybrid_and_sliding_p_stream_every_group_s_blocks() -> None:
    """A Mamba2 + attention P streams too: its layer progress names each KV-cache group's
    blocks (the Mamba group's one state block, the attention group's so far); so does a
    model with a sliding-window group (the planner keeps its writes inside the final window)."""
    s = side([MAMBA, ATTENTION])
    r = request(list(range(300)), {"do_remote_decode": True, "transfer_mode": "layerwise", "layerwise_id": "k1"})
    s.on_new_request(r)
    step = s.build_step(_output([SimpleNamespace(req_id="r1", block_ids=([7], [4, 5]), num_computed_tokens=0)],
                                scheduled={"r1": 256}))
    assert r.num_prompt_tokens == 299  # P stops one short: it computes and ships 299 tokens
    assert step.streams[0]["num_tokens"] == 299
    assert step.layer_progress == [{"request_id": "r1", "block_ids": [[7], [4, 5]], "end": 256}]
    chunk = SimpleNamespace(req_ids=["r1"], resumed_req_ids=set(), new_block_ids=[([], [9])], num_computed_tokens=[256])
    assert s.build_step(_output(cached=chunk, scheduled={"r1": 43})).layer_progress == [
        {"request_id": "r1", "block_ids": [[7], [4, 5, 9]], "end": 299}]
    window = GroupInfo("sliding", ("model.layers.0.self_attn.attn",), "float32", num_kv_heads=1, head_dim=64,
                       block_size=128, sliding_window=64)
    sliding = side([window, ATTENTION])
    r2 = request(list(range(300)), {"do_remote_decode": True, "transfer_mode": "layerwise", "layerwise_id": "k2"})
    sliding.on_new_request(r2)
    step = sliding.build_step(_output([SimpleNamespace(req_id="r1", block_ids=([4, 5], [4, 5]), num_computed_tokens=0)],
                                      scheduled={"r1": 256}))
    assert step.layer_progress == [{"request_id": "r1", "block_ids": [[4, 5], [4, 5]], "end": 256}]
