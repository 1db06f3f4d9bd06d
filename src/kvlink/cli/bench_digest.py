"""`kvlink bench digest`: hash throughput of candidate KV digests on KV-sized buffers, one core.

Why kvlink digests with xxh3-64 (`kvlink.connector.integrity`): the candidates below are the
maintained libraries a Python process can call without copying the buffer; each is timed on
buffers of one head of one page up to a whole request, best of several passes. CRC32C
through the `crc32c` package (hardware instructions) is timed when that package is
installed; kvlink does not depend on it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from kvlink.cli.argtypes import output_file
from kvlink.cli.ranges import ranged
from kvlink.layout.limits import COUNT

SIZES = (4 << 10, 16 << 10, 48 << 10, 1536 << 10, 12 << 20)
Digest = Callable[[memoryview], object]


def candidates() -> dict[str, Digest]:
    found: dict[str, Digest] = {
        "xxh3_64": xxhash.xxh3_64_intdigest,
        "xxh3_128": xxhash.xxh3_128_intdigest,
        "xxh64": xxhash.xxh64_intdigest,
        "zlib.crc32": zlib.crc32,
        "blake2b-64": lambda b: hashlib.blake2b(b, digest_size=8).digest(),
    }
    try:
        import crc32c  # type: ignore[import-not-found]

        found["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    return found


def measure(size: int, total_bytes: int, passes: int, digest: Digest, data: memoryview) -> dict[str, float]:
    count = max(1, total_bytes // size)
    views = [data[(i * size) % (len(data) - size + 1):][:size] for i in range(count)]
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for view in views:
            digest(view)
        best = min(best, time.perf_counter() - start)
    return {"gbps": size * count / best / 1e9, "us_per_call": best / count * 1e6}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", type=ranged(COUNT), default=5, help="timed passes per size (best kept)")
    parser.add_argument("--json", type=output_file, metavar="FILE", help="also write the results to FILE")


def run(args: argparse.Namespace) -> int:
    data = memoryview(np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes())
    results: dict[str, Any] = {"sizes": list(SIZES), "digests": {}}
    for name, digest in candidates().items():
        rows = {}
        for size in SIZES:
            rows[str(size)] = measure(size, 48 << 20, args.passes, digest, data)
        results["digests"][name] = rows
        cells = "  ".join(f"{size >> 10:>6} KiB {rows[str(size)]['gbps']:5.1f} GB/s" for size in SIZES)
        print(f"{name:>11}: {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0
