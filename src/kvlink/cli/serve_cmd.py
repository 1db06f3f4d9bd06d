"""`kvlink serve`: one OpenAI-compatible instance (prefill, decode, or both) on one port."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tracemalloc

from kvlink.cli.ranges import ranged
from kvlink.connector.config import ConnectorConfig
from kvlink.layout.limits import (
    BLOCK_SIZE,
    MAX_PORT,
    MAX_TP,
    NUM_BLOCKS,
    PORT,
    PORT_OR_EPHEMERAL,
    SECONDS,
    SECONDS_OR_ZERO,
    THREADS,
    TOKENS,
    TOKENS_OR_ZERO,
    TP,
    Bound,
)
from kvlink.layout.presets import SMOLLM2_135M, TINY_HYBRID, TINY_HYBRID_SD
from kvlink.layout.spec import ModelSpec
from kvlink.layout.tensors import kv_pool_bytes
from kvlink.serve.factory import MODEL_NAMES

# The KV geometry each served model allocates (the engine builds its caches from these).
SERVED_SPECS: dict[str, ModelSpec] = {"smollm2-135m": SMOLLM2_135M, "tiny-hybrid": TINY_HYBRID,
                                     "tiny-hybrid-sd": TINY_HYBRID_SD}
# The connector's own defaults and ranges, so the command line refuses what the config would.
VERIFY_DEFAULT = ConnectorConfig.verify_kv
SAMPLE_UNITS_DEFAULT = ConnectorConfig.verify_sample_units
SAMPLE_UNITS: Bound = next(f.metadata["bound"] for f in dataclasses.fields(ConnectorConfig)
                           if f.name == "verify_sample_units")
VERIFY_MODES = ("off", "sample", "full")  # what ConnectorConfig.verify_kv takes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    seconds = ranged(SECONDS)
    parser.add_argument("--role", choices=("prefill", "decode", "both"), default="both",
                        help="P (keeps KV for a decode instance), D (loads KV from P), or both")
    parser.add_argument("--model", choices=MODEL_NAMES, default="smollm2-135m")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=ranged(PORT), default=8000)
    parser.add_argument("--tp", type=ranged(TP), default=1, help=f"tensor-parallel ranks (1..{MAX_TP})")
    parser.add_argument("--engine-id", default=None, help="connector engine id (default: random)")
    parser.add_argument("--kv-host", default=None,
                        help="address the KV side channel listens on and advertises (default: --host); "
                             "a D whose HTTP and KV networks differ (push, layerwise) needs the KV one")
    parser.add_argument("--kv-port", type=ranged(PORT_OR_EPHEMERAL), default=None,
                        help="side-channel port for KV handshakes (P and D roles); rank r listens "
                             "on --kv-port + r (default or 0: an ephemeral port)")
    parser.add_argument("--num-blocks", type=ranged(NUM_BLOCKS), default=128,
                        help="logical KV blocks per group (the pool must fit in this machine's memory)")
    parser.add_argument("--block-size", type=ranged(BLOCK_SIZE), default=16, help="tokens per logical block")
    parser.add_argument("--kernel-block-size", type=ranged(BLOCK_SIZE), default=None,
                        help="tokens per kernel block, dividing --block-size (default: --block-size)")
    parser.add_argument("--load-failure-policy", choices=("fail", "recompute"), default="fail")
    parser.add_argument("--transfer-mode", choices=("pull", "push", "layerwise"), default="pull",
                        help="P: how D gets the KV unless a request says (layerwise: P writes each layer "
                             "into D's blocks while it prefills, when D asks first; see docs/layerwise.md)")
    parser.add_argument("--stall-timeout-s", type=seconds, default=10.0,
                        help="a KV transfer with no progress for this long fails (its blocks are invalid)")
    parser.add_argument("--quarantine-s", type=ranged(SECONDS_OR_ZERO), default=60.0,
                        help="after a stalled (not dead) peer, keep the load's blocks out of use this "
                             "long, since a late transfer may still write them")
    parser.add_argument("--lease-s", type=seconds, default=30.0,
                        help="how long P keeps a finished request's blocks for D")
    parser.add_argument("--prefill-chunk", type=ranged(TOKENS_OR_ZERO), default=0,
                        help="prefill long prompts this many tokens per step (chunked prefill; "
                             "layerwise then writes each chunk's layers as they are computed); 0: whole prompts")
    parser.add_argument("--max-model-len", type=ranged(TOKENS), default=None,
                        help="cap on prompt + completion tokens (default: what the blocks hold)")
    parser.add_argument("--request-timeout-s", type=seconds, default=120.0,
                        help="abort a request that produces nothing for this long")
    parser.add_argument("--tp-step-timeout-s", type=seconds, default=60.0,
                        help="with --tp: a collective inside a step (all-reduce, gathering the "
                             "connector's outputs) that waits this long on a rank fails the engine "
                             "with an error instead of hanging (a frozen or dead rank)")
    parser.add_argument("--threads", type=ranged(THREADS), default=None, help="torch CPU threads")
    parser.add_argument("--progress-thread", action=argparse.BooleanOptionalAction, default=True,
                        help="run NIXL's progress thread (sleeps up to 1 ms between polls), so a "
                             "peer's READs of this instance's KV progress while a forward pass "
                             "runs (default: on; without it KV moves wait for the engine loop)")
    parser.add_argument("--verify-kv", choices=VERIFY_MODES, default=VERIFY_DEFAULT,
                        help="P and D roles: end-to-end KV checksums. P seals what it ships unless "
                             "off; D checks what it read before the request runs: every unit "
                             "(full), --verify-sample-units of them per P rank (sample), or none "
                             f"(off). A mismatch fails the load (default: {VERIFY_DEFAULT})")
    parser.add_argument("--verify-sample-units", type=ranged(SAMPLE_UNITS), default=SAMPLE_UNITS_DEFAULT,
                        help=f"D with --verify-kv sample: units checked per P rank and load, "
                             f"{SAMPLE_UNITS.describe()} (default: {SAMPLE_UNITS_DEFAULT})")
    parser.add_argument("--secret-file", default=None, metavar="PATH",
                        help="P and D roles: file holding the deployment's shared secret (default: "
                             "$KVLINK_SECRET); P signs kv_transfer_params with it, D refuses any "
                             "it cannot verify. Required unless --insecure-unsigned-params")
    parser.add_argument("--insecure-unsigned-params", action="store_true",
                        help="P and D roles: run without a shared secret; any client that reaches D "
                             "can then make it read other requests' KV from P (logged as a WARNING, "
                             "shown on /health and /metrics)")
    parser.add_argument("--log-level", type=str.lower, default="info",
                        choices=("debug", "info", "warning", "error", "critical"))


def check_args(args: argparse.Namespace) -> None:
    kernel = args.kernel_block_size or args.block_size
    if args.block_size % kernel:
        raise ValueError(f"--kernel-block-size {kernel} must divide --block-size {args.block_size}")
    if args.kv_port and args.kv_port + args.tp - 1 > MAX_PORT:
        raise ValueError(f"--kv-port {args.kv_port} with --tp {args.tp}: rank r listens on --kv-port + r, "
                         f"so --kv-port must be at most {MAX_PORT - args.tp + 1}")
    check_pool_fits(args.model, args.tp, args.block_size, kernel, args.num_blocks)


def check_pool_fits(model: str, tp: int, block_size: int, kernel_block_size: int, num_blocks: int) -> None:
    """Refuse KV pools (every rank runs on this machine) larger than its memory, before allocating."""
    spec = SERVED_SPECS[model]
    try:
        per_rank = kv_pool_bytes(spec, tp, block_size, kernel_block_size, num_blocks)
    except ValueError as error:
        raise ValueError(f"--model {model} with --tp {tp}: {error}") from None
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if per_rank * tp > physical:
        raise ValueError(f"--num-blocks {num_blocks} of --block-size {block_size} tokens needs "
                         f"{per_rank / 2**30:.1f} GiB of KV memory per rank for {model}, "
                         f"{per_rank * tp / 2**30:.1f} GiB for --tp {tp}, more than this machine's "
                         f"{physical / 2**30:.1f} GiB; use fewer blocks")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvlink.serve import memory
    from kvlink.serve.api_server import build_app
    from kvlink.serve.engine_loop import AsyncEngine
    from kvlink.serve.factory import build_engine
    from kvlink.serve.listen import ListenError, check_free, check_kv_ports, listen, serve
    from kvlink.serve.metrics import MetricsRegistry
    from kvlink.serve.upstream import SERVER_KEEPALIVE_S

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # a taken port or an address that does not resolve is refused before the model loads
        check_free(args.host, [args.port])
        if args.role != "both":
            check_kv_ports(args.kv_host or args.host, [args.kv_port + r if args.kv_port else 0 for r in range(args.tp)])
    except ListenError as error:
        print(f"kvlink serve: {error}", file=sys.stderr, flush=True)
        return 2
    try:
        trace_frames = memory.tracing_frames()
        served = build_engine(args, progress=lambda line: print(line, flush=True))
    except (ValueError, NotImplementedError, FileNotFoundError) as error:
        print(f"kvlink serve: {error}", file=sys.stderr, flush=True)
        return 2
    except OSError as error:  # a file the model needs, or a port taken since the check
        print(f"kvlink serve: cannot start: {error}", file=sys.stderr, flush=True)
        return 2
    try:  # listens only now: until the engine is up, a connection is refused, not left waiting
        sockets = listen(args.host, args.port)
    except ListenError as error:
        if served.close is not None:
            served.close()
        print(f"kvlink serve: {error}", file=sys.stderr, flush=True)
        return 2
    if trace_frames:
        tracemalloc.start(trace_frames)  # after loading: traces what serving allocates
    engine = AsyncEngine(served.engine, request_timeout_s=args.request_timeout_s)
    metrics = MetricsRegistry("kvlink_server")
    if served.connector_metrics is not None:
        metrics.fragments.append(served.connector_metrics)
    if args.role != "both" and args.insecure_unsigned_params:
        metrics.gauges["insecure_unsigned_params"] = lambda: 1.0
    app = build_app(engine, served.tokenizer, served.model_name, args.role, metrics,
                    max_model_len=served.max_model_len, warnings=served.warnings,
                    kv_endpoint=served.kv_endpoint)
    url = f"http://{args.host}:{args.port}"
    app.router.add_event_handler(
        "startup", lambda: print(f"kvlink {args.role} instance serving {served.model_name} "
                                 f"on {url}", flush=True))
    engine.start()
    try:
        serve(app, sockets, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
              timeout_keep_alive=SERVER_KEEPALIVE_S)
    finally:
        engine.shutdown()
        if served.close is not None:
            try:
                served.close()
            except Exception as error:  # a TP follower already gone (killed): nothing left to stop
                print(f"kvlink serve: stopped, without an orderly stop of every TP rank: {error}",
                      file=sys.stderr, flush=True)
    # Everything that holds a peer's or a client's state is stopped: leave without the
    # interpreter's teardown of torch, UCX and NIXL (about 1 s here, once per stop).
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
