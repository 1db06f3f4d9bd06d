"""Two P and two D instances from one `ClusterSpec`: every P/D pair moves KV and answers like
colocated, each D knows both P engines, and the proxy in front serves too."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from e2e_helpers import assert_clean, cluster_for, complete, completion_text, spec

from kvlink.bench.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from cluster_for(replace(spec("tiny-hybrid"), n_prefill=2, n_decode=2), tmp_path_factory,
                           "tiny-2p-2d")


def test_every_prefill_decode_pair_moves_kv_and_equals_colocated(two_by_two: Cluster) -> None:
    assert two_by_two.colocated is not None and two_by_two.proxy is not None
    prefills, decodes = two_by_two.roles("prefill"), two_by_two.roles("decode")
    assert (len(prefills), len(decodes)) == (2, 2)
    for n, (p, d) in enumerate((p, d) for p in prefills for d in decodes):
        prompt = [1000 + 97 * n + k for k in range(40)]
        want, _ = completion_text(two_by_two.colocated.url, prompt, MAX_TOKENS)
        held = complete(p.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
        assert held.status_code == 200, held.text
        params = held.json()["kv_transfer_params"]
        assert params["remote_engine_id"] == p.engine_id
        answer = complete(d.url, prompt, MAX_TOKENS, kv_transfer_params=params)
        assert answer.status_code == 200, f"{p.name} -> {d.name}: {answer.text}"
        body = answer.json()
        assert body["choices"][0]["text"] == want, f"{p.name} -> {d.name}"
        assert body["kvlink"]["kv_bytes"] > 0
    for d in decodes:
        remote = two_by_two.state(d.name)["engine"]["connector"]["remote_engines"]
        assert {p.engine_id for p in prefills} <= set(remote), f"{d.name} knows {remote}"
    got, _ = completion_text(two_by_two.proxy.url, [5000 + k for k in range(30)], MAX_TOKENS)
    want, _ = completion_text(two_by_two.colocated.url, [5000 + k for k in range(30)], MAX_TOKENS)
    assert got == want
    assert_clean(two_by_two)
