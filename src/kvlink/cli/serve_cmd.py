"""`kvlink serve`: one OpenAI-compatible instance (prefill, decode, or both) on one port."""

from __future__ import annotations

import argparse
import logging
import tracemalloc

from kvlink.serve.factory import MODEL_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=("prefill", "decode", "both"), default="both",
                        help="P (keeps KV for a decode instance), D (loads KV from P), or both")
    parser.add_argument("--model", choices=MODEL_NAMES, default="smollm2-135m")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--engine-id", default=None, help="connector engine id (default: random)")
    parser.add_argument("--kv-port", type=int, default=None,
                        help="side-channel port for KV handshakes (P and D roles)")
    parser.add_argument("--num-blocks", type=int, default=128, help="logical KV blocks per group")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per logical block")
    parser.add_argument("--kernel-block-size", type=int, default=None,
                        help="tokens per kernel block (default: --block-size)")
    parser.add_argument("--load-failure-policy", choices=("fail", "recompute"), default="fail")
    parser.add_argument("--transfer-mode", choices=("pull", "push"), default="pull")
    parser.add_argument("--stall-timeout-s", type=float, default=10.0,
                        help="a KV transfer with no progress for this long fails (its blocks are invalid)")
    parser.add_argument("--quarantine-s", type=float, default=60.0,
                        help="after a stalled (not dead) peer, keep the load's blocks out of use this "
                             "long, since a late transfer may still write them")
    parser.add_argument("--lease-s", type=float, default=30.0,
                        help="how long P keeps a finished request's blocks for D")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="cap on prompt + completion tokens (default: what the blocks hold)")
    parser.add_argument("--request-timeout-s", type=float, default=120.0,
                        help="abort a request that produces nothing for this long")
    parser.add_argument("--tp-step-timeout-s", type=float, default=60.0,
                        help="with --tp: a collective inside a step (all-reduce, gathering the "
                             "connector's outputs) that waits this long on a rank fails the engine "
                             "with an error instead of hanging (a frozen or dead rank)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--progress-thread", action=argparse.BooleanOptionalAction, default=True,
                        help="run NIXL's progress thread (sleeps up to 1 ms between polls), so a "
                             "peer's READs of this instance's KV progress while a forward pass "
                             "runs (default: on; without it KV moves wait for the engine loop)")
    parser.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from kvlink.serve import memory
    from kvlink.serve.api_server import build_app
    from kvlink.serve.engine_loop import AsyncEngine
    from kvlink.serve.factory import build_engine
    from kvlink.serve.metrics import MetricsRegistry

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        trace_frames = memory.tracing_frames()
        served = build_engine(args, progress=lambda line: print(line, flush=True))
    except (ValueError, NotImplementedError, FileNotFoundError) as error:
        print(f"kvlink serve: {error}", flush=True)
        return 2
    if trace_frames:
        tracemalloc.start(trace_frames)  # after loading: traces what serving allocates
    engine = AsyncEngine(served.engine, request_timeout_s=args.request_timeout_s)
    metrics = MetricsRegistry("kvlink_server")
    if served.connector_metrics is not None:
        metrics.fragments.append(served.connector_metrics)
    app = build_app(engine, served.tokenizer, served.model_name, args.role, metrics,
                    max_model_len=served.max_model_len)
    url = f"http://{args.host}:{args.port}"
    app.router.add_event_handler(
        "startup", lambda: print(f"kvlink {args.role} instance serving {served.model_name} "
                                 f"on {url}", flush=True))
    engine.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    access_log=False, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
        if served.close is not None:
            served.close()
    return 0
