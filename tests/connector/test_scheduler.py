"""Scheduler side: params P hands out, loads D schedules, aborts, heartbeats."""

from __future__ import annotations

import pytest

from kvlink.connector.api import RequestView, WorkerOutput
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.notifs import MAX_REQUEST_ID_BYTES
from kvlink.connector.params import ForbiddenTransferParams, InvalidTransferParams
from kvlink.connector.scheduler import NixlScheduler
from kvlink.layout.presets import TINY_HYBRID


def unsigned(engine_id: str, **kw: object) -> ConnectorConfig:
    """These tests are about scheduling, not trust: hand-made params, signing switched off
    (tests/badinput/test_transfer_params.py covers the signatures)."""
    return ConnectorConfig(engine_id, insecure_unsigned_params=True, **kw)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def p_params(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "p-1",
        "remote_block_ids": [[4, 5, 6]], "remote_host": "127.0.0.1", "remote_port": 5600,
        "tp_size": 2,
    }
    base.update(over)
    return base


def test_without_verify_kv_saves_carry_no_tokens() -> None:
    s = NixlScheduler(unsigned("P", verify_kv="off"), tp_size=1)
    s.request_finished(RequestView("r1", list(range(40)), {"do_remote_decode": True}), [[1, 2, 3]], aborted=False)
    assert s.build_step_metadata().saves == [{"request_id": "r1", "block_ids": [[1, 2, 3]]}]


def test_prefill_finish_holds_blocks_and_returns_vllm_fields() -> None:
    s = NixlScheduler(unsigned("P", side_channel_port=7000), tp_size=2)
    req = RequestView("r1", list(range(40)), {"do_remote_decode": True})
    delay, params = s.request_finished(req, [[1, 2, 3]], aborted=False)
    assert delay and params is not None
    assert params["remote_block_ids"] == [[1, 2, 3]]
    assert params["remote_port"] == 7000 and params["tp_size"] == 2
    assert params["remote_num_tokens"] == 39 and params["do_remote_prefill"] is True
    step = s.build_step_metadata()
    # with verify_kv on (the default) P's workers get the tokens they seal the KV of
    assert step.saves == [{"request_id": "r1", "block_ids": [[1, 2, 3]], "num_tokens": 39,
                           "token_ids": list(range(39))}]
    assert s.has_pending_work()
    s.update_connector_output(WorkerOutput(finished_sending={"r1"}))
    assert not s.has_pending_work()


def test_aborted_prefill_frees_at_once() -> None:
    s = NixlScheduler(unsigned("P"), tp_size=1)
    req = RequestView("r1", [1, 2, 3], {"do_remote_decode": True})
    assert s.request_finished(req, [[1]], aborted=True) == (False, None)
    assert not s.build_step_metadata().saves


def test_decode_loads_missing_tokens_only() -> None:
    s = NixlScheduler(unsigned("D"), tp_size=1)
    req = RequestView("d1", list(range(33)), p_params())
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 16) == (16, True)
    s.update_state_after_alloc(req, [[9, 8, 7]], 16, 16)
    step = s.build_step_metadata()
    (load,) = step.loads
    assert load["local_block_ids"] == [[9, 8, 7]] and load["local_computed_tokens"] == 16
    assert load["num_tokens"] == 32 and load["remote_request_id"] == "p-1"
    assert s.get_num_new_matched_tokens(req, 16) == (0, False), "a request loads at most once"
    s.update_connector_output(WorkerOutput(finished_recving={"d1"}))
    assert not s.has_pending_work()


def test_full_local_hit_only_notifies() -> None:
    now = [100.0]
    s = NixlScheduler(unsigned("D", handshake_timeout_s=3.0), tp_size=1, clock=lambda: now[0])
    req = RequestView("d1", list(range(17)), p_params())
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 16) == (0, False)
    step = s.build_step_metadata()
    assert not step.loads and [n["remote_request_id"] for n in step.notify_only] == ["p-1"]
    # the workers may have to handshake with P first: the engine keeps stepping, for a bounded time
    assert s.has_pending_work()
    now[0] += 3.0 + 2.0
    assert not s.has_pending_work()


def test_full_local_hit_of_a_hybrid_model_still_loads_the_state() -> None:
    s = NixlScheduler(unsigned("D"), tp_size=1, model=TINY_HYBRID)
    req = RequestView("d1", list(range(17)), p_params())
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 16) == (0, True)
    s.update_state_after_alloc(req, [[9, 8], [3]], 0, 16)
    step = s.build_step_metadata()
    (load,) = step.loads
    assert not step.notify_only
    assert load["local_computed_tokens"] == load["num_tokens"] == 16
    assert load["local_block_ids"] == [[9, 8], [3]]


def test_one_token_prompt_of_a_hybrid_model_only_notifies() -> None:
    """No token precedes it: D starts from the zero state, so nothing moves."""
    s = NixlScheduler(unsigned("D"), tp_size=1, model=TINY_HYBRID)
    req = RequestView("d1", [7], p_params())
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert [n["remote_request_id"] for n in s.build_step_metadata().notify_only] == ["p-1"]


def test_abort_before_allocation_notifies_prefill() -> None:
    s = NixlScheduler(unsigned("D"), tp_size=1)
    req = RequestView("d1", list(range(17)), p_params())
    s.on_new_request(req)
    assert s.request_finished(req, [], aborted=True) == (False, None)
    assert [n["remote_request_id"] for n in s.build_step_metadata().notify_only] == ["p-1"]


@pytest.mark.parametrize("mode", ["pull", "push", "layerwise"])
def test_abort_during_a_push_load_cancels_it_and_nothing_else(mode: str) -> None:
    """A push or layerwise load in flight is P's to stop (`cancels`); a pull's READ is ours
    and ends by itself; a load that already ended cancels nothing."""
    s = NixlScheduler(unsigned("D"), tp_size=1)
    for rid in ("d1", "d2"):
        blocks = [] if mode == "layerwise" else [[4, 5]]  # layerwise: P has not allocated yet
        req = RequestView(rid, list(range(17)), p_params(transfer_mode=mode, remote_request_id=f"p-{rid}",
                                                         remote_block_ids=blocks))
        s.on_new_request(req)
        assert s.get_num_new_matched_tokens(req, 0) == (16, True)
        s.update_state_after_alloc(req, [[1, 2]], 16, 0)
    s.build_step_metadata()
    s.update_connector_output(WorkerOutput(finished_recving={"d2"}))
    for rid in ("d1", "d2"):
        assert s.request_finished(RequestView(rid, list(range(17)), {}), [[1, 2]], aborted=True) == (False, None)
    step = s.build_step_metadata()
    assert step.cancels == ([] if mode == "pull" else ["d1"]) and not step.notify_only


def test_heartbeats_grouped_per_engine_at_interval() -> None:
    clock = Clock()
    s = NixlScheduler(unsigned("D", lease_s=6.0), tp_size=1, clock=clock)
    for i in range(3):
        s.on_new_request(RequestView(f"d{i}", [1, 2, 3], p_params(remote_request_id=f"p{i}")))
    (hb,) = s.build_step_metadata().heartbeats
    assert sorted(hb["remote_request_ids"]) == ["p0", "p1", "p2"]
    clock.now = 0.5
    assert not s.build_step_metadata().heartbeats
    clock.now = 1.0
    assert s.build_step_metadata().heartbeats


@pytest.mark.parametrize(
    "bad",
    [
        {"remote_block_ids": [[-1]]},
        {"remote_block_ids": "1,2"},
        {"remote_port": 0},
        {"tp_size": "2"},
        {"remote_engine_id": None},
        {"transfer_mode": "teleport"},
        {"remote_block_ids": [[1, 1]]},
    ],
)
def test_invalid_params_are_refused_with_the_field_named(bad: dict[str, object]) -> None:
    s = NixlScheduler(unsigned("D"), tp_size=1)
    with pytest.raises(InvalidTransferParams) as err:
        s.on_new_request(RequestView("d1", [1, 2], p_params(**bad)))
    assert "kv_transfer_params" in str(err.value) or "remote" in str(err.value)


def test_params_handed_back_unused_name_the_held_request_only_when_p_issued_them() -> None:
    """A router hands P's params back when no decoder got them (`held_by_params`): P names
    the request to free only for params it signed, in their lease, of its own start; other
    engines' and altered params are refused, expired ones and an earlier start's name nothing."""
    wall = Clock()
    wall.now = 1000.0
    config = ConnectorConfig("P", secret=b"s" * 32, incarnation="inc2", lease_s=30.0)
    s = NixlScheduler(config, tp_size=1, wall_clock=wall)
    _, params = s.request_finished(RequestView("r1", list(range(40)), {"do_remote_decode": True}), [[1, 2, 3]],
                                   aborted=False)
    assert params is not None
    assert s.held_by_params(params) == "r1"
    assert s.release_held("r1") and s.build_step_metadata().frees == ["r1"]
    with pytest.raises(ForbiddenTransferParams, match="does not match"):
        s.held_by_params({**params, "remote_block_ids": [[1, 2, 4]]})
    with pytest.raises(ForbiddenTransferParams, match="this is 'P'"):
        s.held_by_params({**params, "remote_engine_id": "Q"})
    with pytest.raises(InvalidTransferParams):
        s.held_by_params({**params, "remote_block_ids": "nope"})
    other = NixlScheduler(ConnectorConfig("P", secret=b"s" * 32, incarnation="inc3"), tp_size=1, wall_clock=wall)
    assert other.held_by_params(params) is None  # issued before this start
    # r1's blocks went back; a later request under the same id is not freed by r1's old params
    s.update_connector_output(WorkerOutput(finished_sending={"r1"}))
    wall.now += 1.0
    _, again = s.request_finished(RequestView("r1", list(range(40)), {"do_remote_decode": True}), [[7, 8, 9]],
                                  aborted=False)
    assert again is not None
    assert s.held_by_params(params) is None
    assert s.held_by_params(again) == "r1"
    wall.now += 31.0
    assert s.held_by_params(params) is None  # the lease is over


def test_p_keeps_no_kv_for_a_request_whose_id_no_notification_could_carry() -> None:
    """D's Done names P's request id, and P drops notifications over 64 KiB: P would hold the
    blocks of an id longer than that until its lease, and D's heartbeats would be dropped."""
    s = NixlScheduler(unsigned("P"), tp_size=1)
    long_id = "r" * (MAX_REQUEST_ID_BYTES + 1)
    assert s.request_finished(RequestView(long_id, [1, 2, 3], {"do_remote_decode": True}), [[1]],
                              aborted=False) == (False, None)
    assert not s.build_step_metadata().saves and not s.has_pending_work()
    fits = "r" * MAX_REQUEST_ID_BYTES
    delay, params = s.request_finished(RequestView(fits, [1, 2, 3], {"do_remote_decode": True}), [[1]],
                                       aborted=False)
    assert delay and params is not None and params["remote_request_id"] == fits


@pytest.mark.parametrize("rid", ["", "é" * (MAX_REQUEST_ID_BYTES // 2 + 1)])
def test_d_refuses_params_naming_a_request_id_no_notification_could_carry(rid: str) -> None:
    s = NixlScheduler(unsigned("D"), tp_size=1)
    with pytest.raises(InvalidTransferParams, match="remote_request_id must be 1 to 4096 bytes"):
        s.on_new_request(RequestView("d1", [1, 2], p_params(remote_request_id=rid)))
