"""tiny-hybrid (attention + Mamba2) through P -> proxy -> D with heterogeneous TP, real processes:
the greedy answer equals the colocated one token for token (SSM state and head-sharded KV moved)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_helpers import assert_clean, cluster_for, completion_text, spec

from kvlink.bench.serve_cluster import Cluster

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
    tiny = spec(MODEL)
    only = type(tiny)(**{**tiny.__dict__, "pd": False})
    yield from cluster_for(only, tmp_path_factory, "tiny-colocated")


@pytest.fixture(scope="module", params=[(1, 2), (2, 1)], ids=["p1-d2", "p2-d1"])
def pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    p_tp, d_tp = request.param
    yield from cluster_for(spec(MODEL, p_tp, d_tp, colocated=False), tmp_path_factory,
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
