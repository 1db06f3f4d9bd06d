"""`Cluster.add_router`: a second router on the same instances, stopped with the rest."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvlink.bench.cluster import Cluster, ClusterSpec

pytestmark = [pytest.mark.timeout(120)]


def test_added_router_points_at_the_same_instances_and_stops_with_the_cluster(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSpec(model="tiny-hybrid", n_prefill=2, n_decode=1), tmp_path, progress=lambda _: None)
    try:
        added = cluster.add_router("kvlink")  # kvlink's proxy is healthy before its instances are
        assert added in cluster.services() and added.url != f"http://127.0.0.1:{cluster.proxy_port}"
        health = httpx.get(added.url + "/health", timeout=5).json()
        described = str(health["prefill"]) + str(health["decode"])
        for m in cluster.members:
            assert str(m.port) in described, f"{m.name} missing from {health}"
    finally:
        cluster.stop()
    assert added.proc.poll() is not None, "the added router outlived Cluster.stop()"
