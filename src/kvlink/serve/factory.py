"""Builds what `kvlink serve` runs: the model, its tokenizer, the engine, and its connector.

Role `both` is a plain colocated engine. Roles `prefill` and `decode` attach the NIXL
connector (scheduler side + this rank's worker) and need the deployment's shared secret
(`$KVLINK_SECRET` or `--secret-file`), unless `--insecure-unsigned-params` opts out. With
`--tp N` ranks 1..N-1 run in follower processes (`engine.tp_worker`) that mirror rank 0 over gloo.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlink.engine.models import MODEL_NAMES, load_model

Progress = Callable[[str], None]
log = logging.getLogger("kvlink.serve")
__all__ = ["MODEL_NAMES", "ServedEngine", "build_engine"]


@dataclass
class ServedEngine:
    """Everything the HTTP layer needs from the engine side."""

    engine: Any  # kvlink.engine.engine.LLMEngine
    tokenizer: Any  # kvlink.engine.tokenizer.Tokenizer
    model_name: str
    max_model_len: int
    connector_metrics: Callable[[], str] | None = None  # Prometheus text of the connector
    close: Callable[[], None] | None = None  # releases connector resources (agent, sockets)
    debug_state: Callable[[], dict[str, Any]] | None = None  # connector state (leases, loads)
    warnings: tuple[str, ...] = ()  # what is unsafe about this configuration (logged, on /health)
    # P: where a D asks for a layerwise push (the proxy gives it to D before P has the request)
    kv_endpoint: dict[str, Any] | None = None


def _connector_config(args: argparse.Namespace) -> Any:
    from kvlink.connector.config import ConnectorConfig
    from kvlink.connector.secret import load_secret, require_secret

    engine_id = args.engine_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
    secret = load_secret(getattr(args, "secret_file", None))
    insecure = bool(getattr(args, "insecure_unsigned_params", False))
    if secret is not None and insecure:
        raise ValueError("--insecure-unsigned-params was given, but a secret is set "
                         "($KVLINK_SECRET or --secret-file): drop one of them")
    require_secret(secret, insecure, engine_id)  # refuse now, before the model loads
    return ConnectorConfig(
        engine_id=engine_id, side_channel_host=getattr(args, "kv_host", None) or args.host,
        side_channel_port=args.kv_port if args.kv_port is not None else 0,
        lease_s=args.lease_s, load_failure_policy=args.load_failure_policy,
        transfer_mode=args.transfer_mode, secret=secret, insecure_unsigned_params=insecure,
        stall_timeout_s=getattr(args, "stall_timeout_s", 10.0),
        quarantine_s=getattr(args, "quarantine_s", 60.0),
        verify_kv=getattr(args, "verify_kv", ConnectorConfig.verify_kv),
        verify_sample_units=getattr(args, "verify_sample_units", ConnectorConfig.verify_sample_units),
        incarnation=uuid.uuid4().hex[:8],  # this start of the engine; see ConnectorConfig
    )


def build_engine(args: argparse.Namespace, progress: Progress = print) -> ServedEngine:
    """Model + tokenizer + engine (+ connector) for `args.role`; prints progress while loading."""
    from kvlink.connector.scheduler import NixlScheduler
    from kvlink.connector.stats import PrometheusExporter
    from kvlink.connector.tap import StatsTap
    from kvlink.connector.worker import NixlWorker
    from kvlink.engine.engine import LLMEngine
    from kvlink.engine.model import smollm2_gguf_path
    from kvlink.engine.tokenizer import Tokenizer
    from kvlink.engine.tp import TPConnectorWorker, TPModel, all_reduce, init_group, stop_followers
    from kvlink.engine.tp_worker import launch_followers
    from kvlink.procs.launcher import free_port
    from kvlink.transfer.agent_config import AgentConfig

    started = time.monotonic()
    tp = args.tp
    kernel_block_size = args.kernel_block_size or args.block_size
    config = _connector_config(args) if args.role != "both" else None
    warnings: tuple[str, ...] = ()
    if config is not None and config.insecure_unsigned_params:
        from kvlink.connector.secret import INSECURE_WARNING

        warnings = (INSECURE_WARNING,)
        log.warning("%s\nWARNING: %s\n%s", "!" * 80, INSECURE_WARNING, "!" * 80)
    progress_thread = bool(getattr(args, "progress_thread", False))
    followers: list[Any] = []
    step_timeout_s = float(getattr(args, "tp_step_timeout_s", 60.0))
    if tp > 1 and step_timeout_s <= 0:
        raise ValueError(f"--tp-step-timeout-s must be > 0, got {step_timeout_s}")
    if tp > 1:
        port = free_port()
        progress(f"starting {tp - 1} follower rank process(es) for --tp {tp}")
        followers = launch_followers(
            {"model": args.model, "tp": tp, "port": port, "block_size": args.block_size,
             "kernel_block_size": kernel_block_size, "num_blocks": args.num_blocks,
             "progress_thread": progress_thread, "step_timeout_s": step_timeout_s}, config)
        init_group(0, tp, port, step_timeout_s)
    model, model_max_len = load_model(args.model, 0, tp, all_reduce if tp > 1 else None, progress)
    engine_model: Any = TPModel(model) if tp > 1 else model
    progress("loading the tokenizer")
    tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
    scheduler = worker = None
    exporter = PrometheusExporter()
    local_worker: NixlWorker | None = None
    if config is not None:
        scheduler = NixlScheduler(config, tp_size=tp, model=model.spec)
        local_worker = NixlWorker(config, model.spec, tp, 0, args.block_size, kernel_block_size,
                                  args.num_blocks, AgentConfig(progress_thread=progress_thread))
        inner = TPConnectorWorker(local_worker, tp) if tp > 1 else local_worker
        worker = StatsTap(inner, exporter)
    progress(f"allocating {args.num_blocks} KV blocks of {args.block_size} tokens per group")
    engine = LLMEngine(engine_model, args.num_blocks, args.block_size, kernel_block_size,
                       scheduler, worker, args.load_failure_policy,
                       prefill_chunk=getattr(args, "prefill_chunk", 0))
    if config is not None and scheduler is not None and local_worker is not None and config.side_channel_port == 0:
        # An ephemeral side channel: advertise the port we actually got.
        scheduler.config = dataclasses.replace(config, side_channel_port=local_worker.side_channel_port)
    max_model_len = min(model_max_len, args.num_blocks * args.block_size)
    if args.max_model_len:
        max_model_len = min(max_model_len, args.max_model_len)

    def metrics() -> str:
        return exporter.render()

    def close() -> None:
        if worker is not None:
            worker.shutdown()
        elif tp > 1:
            stop_followers()
        for proc in followers:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def debug_state() -> dict[str, Any]:
        return local_worker.debug_state() if local_worker is not None else {}

    if worker is not None and local_worker is not None and config is not None:
        # /metrics shows the connector's figures (at 0) before the first request, so an alert on
        # a counter's increase sees its first one.
        exporter.update(worker.get_stats())
        progress(f"connector {config.engine_id}: KV side channel on "
                 f"{config.side_channel_host}:{local_worker.side_channel_port}, transfer mode {config.transfer_mode}, "
                 f"verify_kv {config.verify_kv}")
    progress(f"model {args.model} ready in {time.monotonic() - started:.1f}s "
             f"(tp={tp}, max_model_len={max_model_len})")
    endpoint = None
    if scheduler is not None and args.role == "prefill":
        endpoint = {"remote_engine_id": scheduler.config.engine_id, "remote_host": scheduler.config.side_channel_host,
                    "remote_port": scheduler.config.side_channel_port, "tp_size": tp}
    return ServedEngine(engine, tokenizer, args.model, max_model_len,
                        metrics if config is not None else None, close, debug_state, warnings, endpoint)
