"""`kvlink bench digest`: every candidate hashes a buffer and reports a throughput."""

from __future__ import annotations

import numpy as np

from kvlink.cli.bench_digest import candidates, measure


def test_each_candidate_is_timed_on_the_buffer() -> None:
    data = memoryview(np.arange(1 << 16, dtype=np.uint8).tobytes())
    seen = []
    for name, digest in candidates().items():
        row = measure(4096, 1 << 16, 2, lambda view, d=digest: seen.append(len(view)) or d(view), data)
        assert row["gbps"] > 0 and row["us_per_call"] > 0, name
    assert set(seen) == {4096}
    assert {"xxh3_64", "zlib.crc32"} <= set(candidates())
