"""Fixtures shared by the fault modules; each module defines its own `cluster`."""

from __future__ import annotations

import pytest
from pd_faults import Expected

from kvlink.bench.cluster import Cluster


@pytest.fixture(scope="module")
def expected(cluster: Cluster) -> Expected:
    """Reference answers from the cluster's colocated instance (`colocated=True`)."""
    assert cluster.colocated is not None
    return Expected(cluster.colocated.url)
