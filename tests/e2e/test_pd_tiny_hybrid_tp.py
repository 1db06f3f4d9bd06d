"""tiny-hybrid (attention + Mamba2) through P -> proxy -> D with heterogeneous TP, real processes:
the greedy answer equals the colocated one token for token (SSM state and head-sharded KV moved),
also when D's prefix cache already holds some or all of the shipped tokens. P TP 1 -> D TP 2 runs
the channel-first ("DS") conv state; P TP 2 -> D TP 1 the row-first one ("SD", vLLM's default),
whose head slices are one piece per conv row. Both compute the same logits (unit-tested), so one
colocated reference serves both."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from e2e_helpers import BLOCK_SIZE, assert_clean, cluster_for, completion_text, spec

from kvlink.bench.cluster import Cluster
from kvlink.layout.presets import TINY_HYBRID, TINY_HYBRID_SD
from kvlink.plan.report import EngineConfig, plan_report

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "tiny-hybrid"
# Token-id prompts: 1 block, several blocks with a partial last one, and a 2-token prompt.
PROMPTS: tuple[list[int], ...] = (
    list(range(1000, 1012)),
    [(7919 * i) % 40000 + 100 for i in range(150)],
    [5000, 6000],
)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    only = dataclasses.replace(spec(MODEL), pd=False)
    yield from cluster_for(only, tmp_path_factory, "tiny-colocated")


@pytest.fixture(scope="module", params=[(1, 2, MODEL), (2, 1, "tiny-hybrid-sd")], ids=["p1-d2", "p2-d1-sd"])
def pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    p_tp, d_tp, model = request.param
    yield from cluster_for(spec(model, p_tp, d_tp, colocated=False), tmp_path_factory,
                           f"tiny-{p_tp}-{d_tp}")


def test_greedy_pd_equals_colocated(pd: Cluster, colocated: Cluster) -> None:
    assert pd.proxy is not None and colocated.colocated is not None
    for prompt in PROMPTS:
        want, _ = completion_text(colocated.colocated.url, prompt, 8)
        got, body = completion_text(pd.proxy.url, prompt, 8)
        assert got == want, f"prompt of {len(prompt)} tokens"
        assert body["usage"]["completion_tokens"] == 8
        assert body["kvlink"]["kv_bytes"] > 0
    assert_clean(pd)


def planned_bytes(cluster: Cluster, prompt_tokens: int, d_computed_tokens: int) -> int:
    """What the planner says D's ranks read together for such a request."""
    p = EngineConfig(cluster.spec.prefill_tp, BLOCK_SIZE, BLOCK_SIZE)
    d = EngineConfig(cluster.spec.decode_tp, BLOCK_SIZE, BLOCK_SIZE)
    model = TINY_HYBRID_SD if cluster.spec.model == "tiny-hybrid-sd" else TINY_HYBRID
    report = plan_report(model, p, d, prompt_tokens, d_computed_tokens)
    return sum(rank["bytes"] for rank in report["d_ranks"])


def test_d_prefix_hits_keep_greedy_exact(pd: Cluster, colocated: Cluster) -> None:
    """A first request leaves 2 full blocks in D's prefix cache. Requests sharing them move only
    the rest of their KV (partial hit) or none of it (full hit: all 32 shipped tokens cached),
    and always P's SSM state after N-1 tokens; the answers equal colocated ones."""
    assert pd.proxy is not None and colocated.colocated is not None
    shared = [(4099 * i) % 40000 + 300 for i in range(2 * BLOCK_SIZE)]
    completion_text(pd.proxy.url, [*shared, 11, 12, 13, 14, 15], 4)
    for name, tail in (("partial", list(range(20000, 20020))), ("full", [20500])):
        prompt = shared + tail
        want, _ = completion_text(colocated.colocated.url, prompt, 8)
        got, body = completion_text(pd.proxy.url, prompt, 8)
        assert got == want, f"{name} hit"
        assert body["kvlink"]["kv_bytes"] == planned_bytes(pd, len(prompt), 2 * BLOCK_SIZE), (
            f"{name} hit: D should read only what its cache lacks, and the state")
    assert_clean(pd)
