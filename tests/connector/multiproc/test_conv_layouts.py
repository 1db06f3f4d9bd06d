"""Hybrid P and D that keep the SSM conv state in different layouts, across processes over
real NIXL: P "DS" (channel-first) -> D "SD" (row-first, vLLM's CPU default) and back, at
TP 1 -> 2 and 2 -> 1, pull and push. D reads the state as P lays it out, checks it against
P's digests, then re-lays it out in place: every byte on every D rank is then exactly the
state in D's own layout, and nothing else changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpeer import Engine, n_blocks, pull_exact, start_engines, stop_engines

from kvlink.bench.transfer_peer import model_from_config
from kvlink.layout.geometry import build_worker_geometry, packed_base_addrs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HYBRID = {"model": "hybrid-mamba2", "block_size": 16, "kernel_block_size": 16, "num_blocks": 40}
ENGINES = {"DS1": ("DS", 1), "SD2": ("SD", 2), "SD1": ("SD", 1), "DS2": ("DS", 2)}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    started = start_engines(
        Path(tmp_path_factory.mktemp("conv-layouts")),
        *({"engine_id": name, "tp": tp, "conv_layout": layout, **HYBRID} for name, (layout, tp) in ENGINES.items()))
    try:
        yield {e.engine_id: e for e in started}
    finally:
        stop_engines(started)


def _conv_bytes_per_rank(tp: int, layout: str) -> int:
    """Bytes of conv state one D rank holds over all its Mamba layers."""
    model = model_from_config({**HYBRID, "conv_layout": layout})
    g = build_worker_geometry(model, tp, 0, 16, 16, 1, packed_base_addrs(model, tp, 16, 16, 1, 0))
    return sum(sum(p.length for p in r.sub_parts[:-1]) for r in g.ssm_regions)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("p_name", "d_name"), [("DS1", "SD2"), ("SD1", "DS2"), ("DS2", "SD1"), ("SD2", "DS1")])
def test_conv_state_arrives_in_d_layout(engines: dict[str, Engine], p_name: str, d_name: str, mode: str) -> None:
    p, d = engines[p_name], engines[d_name]
    rid, seed, prompt = f"conv-{p_name}-{d_name}-{mode}", len(p_name + d_name + mode), 70
    p_ids = [[3 + i for i in range(n_blocks(prompt, 16))], [11 + len(mode)]]
    d_ids = [[30 - i for i in range(n_blocks(prompt, 16))], [5 + len(mode)]]
    before = _counters(d)
    pull_exact(p, d, rid, seed, prompt, p_ids, d_ids, transfer_mode=mode)  # D verifies every byte
    after = _counters(d)
    assert [a.get("conv_relayout_bytes_total", 0) - b.get("conv_relayout_bytes_total", 0)
            for a, b in zip(after, before, strict=True)] == [_conv_bytes_per_rank(d.tp, ENGINES[d_name][0])] * d.tp
    assert all(a["kv_verified_units_total"] > b.get("kv_verified_units_total", 0)  # checked, before the re-layout
               for a, b in zip(after, before, strict=True))
    p.peers[0].wait_until(lambda: p.sent([rid]), 5.0, what="P frees")
    assert all(not s["lease_ids"] for s in p.call("state"))


def _counters(engine: Engine) -> list[dict[str, int]]:
    return [dict(peer.call("stats")["counters"]) for peer in engine.peers]


def test_equal_layouts_move_as_they_lie(engines: dict[str, Engine]) -> None:
    p, d = engines["SD1"], engines["SD2"]
    before = _counters(d)
    pull_exact(p, d, "conv-same", 7, 40, [[1, 2, 3], [20]], [[9, 8, 7], [21]])
    assert [c.get("conv_relayout_bytes_total", 0) for c in _counters(d)] == \
        [c.get("conv_relayout_bytes_total", 0) for c in before]
