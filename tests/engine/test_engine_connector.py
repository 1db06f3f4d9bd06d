"""Engine <-> connector API: remote prefill, load failures, held blocks, aborts (in-test fake connector).

The fake worker "loads" by copying a colocated P engine's blocks (placed per
`layout.kv_tensor_specs`) into the blocks D allocated.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvlink.connector.api import (
    ConnectorScheduler,
    ConnectorWorker,
    LoadFailure,
    LoadFailurePolicy,
    RequestView,
    StepMetadata,
    WorkerOutput,
)
from kvlink.engine.engine import LLMEngine
from kvlink.engine.model.tiny_hybrid import TinyHybridModel
from kvlink.engine.request import RequestOutput, SamplingParams
from kvlink.layout.tensors import kv_tensor_specs

VOCAB, BLOCK, KERNEL_BLOCK, NUM_BLOCKS = 512, 8, 4, 12
PROMPT = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(5)).tolist()
PARAMS = SamplingParams(max_tokens=8)


class FakeConnector(ConnectorScheduler):
    def __init__(self, policy: LoadFailurePolicy = "fail") -> None:
        self.load_failure_policy = policy
        self.new, self.finished = list[str](), list[tuple[str, bool]]()
        self.loads, self.leases = list[dict[str, Any]](), set[str]()

    def on_new_request(self, request: RequestView) -> None:
        self.new.append(request.request_id)

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        remote = (request.kv_transfer_params or {}).get("do_remote_prefill")
        return (len(request.prompt_token_ids) - 1 - num_computed_tokens, True) if remote else (0, False)

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[Sequence[int]], num_external_tokens: int,
        num_computed_tokens: int,
    ) -> None:
        if num_external_tokens:
            remote = (request.kv_transfer_params or {})["remote_block_ids"]
            self.loads.append({"request_id": request.request_id, "remote_block_ids": remote,
                               "local_block_ids": [list(b) for b in block_ids]})

    def build_step_metadata(self) -> StepMetadata:
        metadata, self.loads = StepMetadata(loads=self.loads), []
        return metadata

    def update_connector_output(self, output: WorkerOutput) -> None:
        self.leases -= output.finished_sending

    def request_finished(
        self, request: RequestView, block_ids: Sequence[Sequence[int]], aborted: bool,
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append((request.request_id, aborted))
        if (request.kv_transfer_params or {}).get("do_remote_decode") and not aborted:
            self.leases.add(request.request_id)
            return True, {"do_remote_prefill": True, "remote_block_ids": [list(b) for b in block_ids]}
        return False, None

    def has_pending_work(self) -> bool:
        return bool(self.leases)

    def shutdown(self) -> None: ...


class CopyingWorker(ConnectorWorker):
    """Loads by copying from `source`'s caches; `fail` ids fail, `hold` ids finish only when released."""

    def __init__(self, source: LLMEngine | None = None) -> None:
        self.source, self.local = source, list[torch.Tensor]()
        self.fail, self.hold, self.pending = set[str](), set[str](), WorkerOutput()
        self.quarantine: dict[str, float] = {}  # failed ids reported as stalled: keep blocks this long
        self.failures: dict[str, LoadFailure] = {}  # why a failed id failed, as the real worker says
        self.registered: tuple[list[int], list[int]] | None = None

    def register_kv_caches(self, base_addrs: Sequence[int], nbytes: Sequence[int]) -> None:
        self.registered = (list(base_addrs), list(nbytes))

    def start_load_kv(self, metadata: StepMetadata) -> None:
        for load in metadata.loads:
            request_id = load["request_id"]
            if request_id in self.fail:
                self.pending.failed_recving.add(request_id)
                self.pending.invalid_block_ids.update(load["local_block_ids"][0])
                continue
            assert self.source is not None
            copy_blocks(self.source, self.local, load["remote_block_ids"], load["local_block_ids"])
            self.pending.finished_recving.add(request_id)

    def get_finished(self) -> WorkerOutput:
        done, held = self.pending, self.hold
        self.pending = WorkerOutput(set(), done.finished_recving & held, done.failed_recving & held)
        failed = done.failed_recving - held
        return WorkerOutput(done.finished_sending, done.finished_recving - held, failed,
                            done.invalid_block_ids,
                            quarantine_s={r: s for r, s in self.quarantine.items() if r in failed},
                            load_failures={r: f for r, f in self.failures.items() if r in failed})

    def shutdown(self) -> None: ...


def copy_blocks(source: LLMEngine, local: list[torch.Tensor], remote: list[list[int]], mine: list[list[int]]) -> None:
    ppl = BLOCK // KERNEL_BLOCK
    specs = kv_tensor_specs(source.model.spec, 1, BLOCK, KERNEL_BLOCK, NUM_BLOCKS)
    for spec, src, dst in zip(specs, source.kv_caches, local, strict=True):
        if spec.kind == "ssm":  # the state page is the last block of the group's table
            dst[mine[spec.group][-1]] = src[remote[spec.group][-1]]
            continue
        for remote_block, local_block in zip(remote[spec.group], mine[spec.group], strict=True):
            dst[local_block * ppl : (local_block + 1) * ppl] = src[remote_block * ppl : (remote_block + 1) * ppl]


@pytest.fixture(scope="module")
def model() -> TinyHybridModel:
    return TinyHybridModel(vocab_size=VOCAB, seed=11, eos_token_ids=())


def engine(model: TinyHybridModel, connector: FakeConnector | None = None, worker: CopyingWorker | None = None) -> LLMEngine:
    built = LLMEngine(model, NUM_BLOCKS, BLOCK, KERNEL_BLOCK, connector, worker)
    if worker is not None:
        worker.local = built.kv_caches
    return built


def drain(eng: LLMEngine, max_steps: int = 100) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        for output in eng.step():  # every step, integrity: no overlap, no leak, exact ref counts
            outputs.setdefault(output.request_id, []).append(output)
        eng.check_integrity()
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def assert_all_free(*engines: LLMEngine) -> None:
    for eng in engines:
        eng.check_integrity()
        assert eng.stats()["free_blocks"] == [NUM_BLOCKS] * len(eng.pools)
        assert not eng.has_unfinished()


def prefill_on_p(model: TinyHybridModel) -> tuple[LLMEngine, CopyingWorker, dict[str, Any]]:
    """Run the P side; returns P (blocks still held under the lease), its worker, the params for D."""
    worker = CopyingWorker()
    p = engine(model, FakeConnector(), worker)
    p.add_request("burn", PROMPT[:3], SamplingParams(max_tokens=1))  # P's blocks differ from D's
    p.add_request("x", PROMPT, SamplingParams(max_tokens=1), {"do_remote_decode": True})
    out = drain(p, max_steps=3)["x"]
    assert [(o.finished, o.finish_reason, o.new_token_ids) for o in out] == [(True, "length", [])]
    assert out[0].kv_transfer_params is not None
    assert p.has_unfinished() and p.stats()["held_blocks"] == [2, 1]
    return p, worker, out[0].kv_transfer_params


@pytest.fixture(scope="module")
def colocated(model: TinyHybridModel) -> list[int]:
    eng = engine(model)
    eng.add_request("x", PROMPT, PARAMS)
    return tokens(drain(eng)["x"])


def test_remote_prefill_decodes_like_colocated(model: TinyHybridModel, colocated: list[int]) -> None:
    p, p_worker, params = prefill_on_p(model)
    connector, worker = FakeConnector(), CopyingWorker(source=p)
    d = engine(model, connector, worker)
    assert worker.registered is not None and len(worker.registered[0]) == model.spec.num_layers
    fed, forward = list[int](), model.forward
    d.runner.model = type("Spy", (), {"forward": staticmethod(lambda ids, *a, **k: fed.append(len(ids)) or forward(ids, *a, **k))})()  # type: ignore[assignment]
    d.add_request("x", PROMPT, PARAMS, params)
    assert tokens(drain(d)["x"]) == colocated
    assert fed[0] == 1, "D must recompute only the last prompt token"
    assert connector.new == ["x"] and connector.finished == [("x", False)]
    p_worker.pending.finished_sending.add("x")  # D's notification reached P: the lease ends
    drain(p)
    assert_all_free(p, d)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load_follows_the_policy(model: TinyHybridModel, colocated: list[int], policy: LoadFailurePolicy) -> None:
    p, p_worker, params = prefill_on_p(model)
    worker = CopyingWorker(source=p)
    worker.fail.add("x")
    d = engine(model, FakeConnector(policy), worker)
    d.add_request("x", PROMPT, PARAMS, params)
    out = drain(d)["x"]
    if policy == "recompute":  # prefilled locally, same tokens as a colocated run
        assert tokens(out) == colocated and out[-1].finish_reason == "length"
    else:
        assert [(o.finished, o.finish_reason) for o in out] == [(True, "error")]
        assert "load_failure_policy" in (out[0].error or "") and "'x'" in (out[0].error or "")
    p_worker.pending.finished_sending.add("x")
    drain(p)
    assert_all_free(p, d)


@pytest.mark.parametrize(("failure", "kind"), [
    (LoadFailure("READ failed: nixlRemoteDisconnectError"), "kv_load_failed"),
    (LoadFailure("handshake failed: Connection refused"), "kv_load_failed"),
    (LoadFailure("stalled: no progress for 2s", stalled=True), "kv_load_stalled"),
    (LoadFailure("block ids outside the pool", bad_params=True), "bad_kv_transfer_params"),
    (LoadFailure("P restarted", forbidden=True), "forbidden_kv_transfer_params"),
])
def test_failed_load_under_policy_fail_says_why_in_error_kind(
        model: TinyHybridModel, failure: LoadFailure, kind: str) -> None:
    """The server turns `error_kind` into the HTTP status a router acts on (docs/serving.md)."""
    p, p_worker, params = prefill_on_p(model)
    worker = CopyingWorker(source=p)
    worker.fail.add("x")
    worker.failures["x"] = failure
    d = engine(model, FakeConnector("fail"), worker)
    d.add_request("x", PROMPT, PARAMS, params)
    [out] = drain(d)["x"]
    assert (out.finish_reason, out.error_kind) == ("error", kind)
    assert failure.reason in (out.error or "")
    p_worker.pending.finished_sending.add("x")
    drain(p)
    assert_all_free(p, d)


# Long enough that the recompute (a local prefill and decode) ends inside it on a loaded machine.
QUARANTINE_S = 2.0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_stalled_load_quarantines_its_blocks(model: TinyHybridModel, colocated: list[int],
                                             policy: LoadFailurePolicy) -> None:
    p, p_worker, params = prefill_on_p(model)
    worker = CopyingWorker(source=p)
    worker.fail.add("x")
    worker.quarantine["x"] = QUARANTINE_S
    d = engine(model, FakeConnector(policy), worker)
    free_before = [pool.num_free_blocks for pool in d.pools]
    d.add_request("x", PROMPT, PARAMS, params)
    out = drain(d, max_steps=20)["x"]
    if policy == "recompute":  # prefilled locally in fresh blocks, same tokens as colocated
        assert tokens(out) == colocated
    else:
        assert out[-1].finish_reason == "error"
    stats = d.stats()
    assert sum(stats["quarantined_blocks"]) > 0, "a late transfer could still write these blocks"
    assert sum(b for b in (pool.num_free_blocks for pool in d.pools)) < sum(free_before)
    d.check_integrity()
    time.sleep(QUARANTINE_S + 0.1)
    drain(d)
    p_worker.pending.finished_sending.add("x")
    drain(p)
    assert_all_free(p, d)


def test_held_blocks_stay_out_of_reach_until_finished_sending(model: TinyHybridModel) -> None:
    p, p_worker, _ = prefill_on_p(model)
    held = p.stats()["held_blocks"]
    assert all(p.step() == [] for _ in range(3))
    assert p.stats()["held_blocks"] == held and p.has_unfinished()
    assert p.stats()["free_blocks"] == [NUM_BLOCKS - held[0], NUM_BLOCKS - held[1]]
    p_worker.pending.finished_sending.add("x")
    p.step()
    assert_all_free(p)


def test_abort_while_loading_holds_blocks_until_the_load_ends(model: TinyHybridModel) -> None:
    p, p_worker, params = prefill_on_p(model)
    connector, worker = FakeConnector(), CopyingWorker(source=p)
    worker.hold.add("x")
    d = engine(model, connector, worker)
    d.add_request("x", PROMPT, PARAMS, params)
    assert d.step() == [] and d.stats()["waiting_for_remote_kv"] == 1
    assert d.abort("x")
    assert connector.finished == [("x", True)]
    assert d.stats()["held_blocks"] == [2, 1]
    assert [o.finish_reason for o in d.step()] == ["abort"]
    assert d.stats()["held_blocks"] == [2, 1], "a READ may still be writing these blocks"
    worker.hold.clear()
    drain(d)
    p_worker.pending.finished_sending.add("x")
    drain(p)
    assert_all_free(p, d)


def test_p_requests_that_compute_nothing(model: TinyHybridModel) -> None:
    """Aborted before its prefill: freed at once, no lease. A 1-token prompt: handed over as is."""
    connector, worker = FakeConnector(), CopyingWorker()
    p = engine(model, connector, worker)
    p.add_request("aborted", PROMPT, SamplingParams(max_tokens=1), {"do_remote_decode": True})
    p.add_request("tiny", PROMPT[:1], SamplingParams(max_tokens=1), {"do_remote_decode": True})
    assert p.abort("aborted") and connector.finished == [("aborted", True)]
    out = {o.request_id: o for o in p.step()}
    assert (out["aborted"].finish_reason, out["aborted"].kv_transfer_params) == ("abort", None)
    assert (out["tiny"].finish_reason, out["tiny"].new_token_ids) == ("length", [])
    assert out["tiny"].kv_transfer_params is not None
    worker.pending.finished_sending.add("tiny")
    drain(p)
    assert_all_free(p)
