"""D's cost of `verify_kv` per request, step by step: one P and one D connector worker in one
process over real NIXL, D's load timed from `start_load_kv` to the load reported finished,
with the time D's own thread spends on its check: reserving digest slots (before the KV READ),
taking the check its helper thread planned during the READ, reading the digest slices, and
judging.

    UCX_NET_DEVICES=lo .venv/bin/python scripts/verify_cost.py sample --tokens 512 --layout fragmented

Prints the medians over `--requests` loads after 5 warm-up ones (BENCHMARKS.md, "KV integrity").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from kvmem import real_worker, region_sizes

from kvlink.connector import verifier
from kvlink.connector.api import StepMetadata
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.worker import NixlWorker
from kvlink.layout.presets import preset

WARMUP = 5


def timed(times: dict[str, list[float]], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key].append(time.perf_counter() - start)
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("off", "sample", "full"))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layout", choices=("contiguous", "fragmented"), default="fragmented")
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--layers", type=int, default=15)
    args = parser.parse_args()
    model = preset("llama3-8b")
    model = dataclasses.replace(model, layer_groups=tuple(model.layer_groups[:args.layers]))
    block, tokens = 16, args.tokens
    pool = (tokens + 1) // block + 3
    p_mem, d_mem = real_worker(model, 1, 0, block, block, pool, seed=1), real_worker(model, 1, 0, block, block, pool, seed=2)
    p = NixlWorker(ConnectorConfig("P", side_channel_port=0, verify_kv=args.mode), model, 1, 0, block, block, pool)
    d = NixlWorker(ConnectorConfig("D", side_channel_port=0, verify_kv=args.mode), model, 1, 0, block, block, pool)
    times: dict[str, list[float]] = defaultdict(list)
    try:
        p.register_kv_caches(*region_sizes(p_mem))
        d.register_kv_caches(*region_sizes(d_mem))
        assert d.agent is not None
        post_kv = timed(times, "READ of the KV (post)", d.agent.post)
        post_digests = timed(times, "READ of the digest slices (post)", d.agent.post)
        d.agent.post = lambda *a, **k: (post_digests if isinstance(k.get("tag"), tuple) else post_kv)(*a, **k)  # type: ignore[method-assign]
        for name, key in (("reserve", "D reserves digest slots"), ("claim", "D takes the planned check"),
                          ("judge", "D judges")):
            setattr(verifier.Verifier, name, timed(times, key, getattr(verifier.Verifier, name)))
        blocks = -(-(tokens + 1) // block)
        rng = np.random.default_rng(0)
        prompt = list(range(100, 100 + tokens))
        for i in range(WARMUP + args.requests):
            if args.layout == "contiguous":
                p_ids, d_ids = list(range(blocks)), list(range(blocks))
            else:
                p_ids, d_ids = ([int(x) for x in rng.permutation(pool)[:blocks]],
                                [int(x) for x in rng.permutation(pool)[:blocks]])
            saved = {"request_id": f"p{i}", "block_ids": [p_ids], "token_ids": prompt, "num_tokens": tokens}
            if args.mode != "off":
                p.seal_now([saved])
            p.start_load_kv(StepMetadata(saves=[dict(saved)]))
            load = {"request_id": f"d{i}", "remote_request_id": f"p{i}", "remote_engine_id": "P",
                    "remote_host": "127.0.0.1", "remote_port": p.side_channel_port, "remote_tp_size": 1,
                    "remote_block_ids": [p_ids], "transfer_mode": "pull", "local_block_ids": [d_ids],
                    "local_computed_tokens": 0, "num_tokens": tokens, "token_ids": prompt}
            start = time.perf_counter()
            d.start_load_kv(StepMetadata(loads=[load]))
            while True:
                if i < WARMUP:
                    p.get_finished()  # the first READ needs P to make progress
                out = d.get_finished()
                if out.failed_recving:
                    raise SystemExit(f"load d{i} failed: {out.load_failures}")
                if f"d{i}" in out.finished_recving:
                    break
            times["whole load"].append(time.perf_counter() - start)
            for _ in range(50):  # P frees the blocks once D's done arrived
                p.get_finished()
                if not p.leases.leases:
                    break
            if i % 20 == 0:
                print(f"  {i + 1}/{WARMUP + args.requests} loads", file=sys.stderr, flush=True)
    finally:
        d.shutdown()
        p.shutdown()
    print(f"verify_kv {args.mode}, {tokens} tokens, {args.layout}, medians of {args.requests} loads:")
    for key, values in times.items():
        print(f"  {key}: {statistics.median(values[WARMUP:]) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
