"""A local P/D deployment for demos, benchmarks and end-to-end tests.

One prefill instance, one decode instance and the proxy in front of them, plus
(optionally) a colocated instance to compare against; every process on loopback,
free ports, its own process group and log file, stopped by PID. P and D share a secret
made for this deployment, passed in their environment (not on a command line).
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvlink.connector.secret import SECRET_ENV, new_secret
from kvlink.layout.limits import (
    BLOCK_SIZE,
    MAX_TOKENS,
    NUM_BLOCKS,
    SECONDS,
    TP,
    bounded,
    check_fields,
    int_range,
)
from kvlink.procs.launcher import Service, free_port, start_service, stop_all, wait_healthy

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Placement:
    """Cores and torch threads per process, so that P/D and colocated get a stated CPU share."""

    prefill_cpus: tuple[int, ...] | None = None
    decode_cpus: tuple[int, ...] | None = None
    colocated_cpus: tuple[int, ...] | None = None
    threads_per_rank: int = 1
    colocated_threads: int = 1

    @classmethod
    def pinned(cls) -> Placement:
        """P on core 0 and D on core 1 (one thread each); colocated on both cores, two threads.

        Falls back to unpinned when fewer than two cores are available.
        """
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            return cls()
        return cls((cores[0],), (cores[1],), (cores[0], cores[1]), 1, 2)

    def describe(self) -> str:
        def where(cpus: tuple[int, ...] | None) -> str:
            return "unpinned" if cpus is None else "core" + ("s " if len(cpus) > 1 else " ") + \
                ",".join(map(str, cpus))

        return (f"P {where(self.prefill_cpus)}, D {where(self.decode_cpus)} "
                f"({self.threads_per_rank} torch thread per rank); colocated "
                f"{where(self.colocated_cpus)} ({self.colocated_threads} torch threads); "
                "proxy and client unpinned")


@dataclass(frozen=True)
class ClusterSpec:
    model: str = "smollm2-135m"
    prefill_tp: int = bounded(TP, 1)
    decode_tp: int = bounded(TP, 1)
    num_blocks: int = bounded(NUM_BLOCKS, 128)
    block_size: int = bounded(BLOCK_SIZE, 16)
    pd: bool = True  # start P, D and the proxy
    colocated: bool = True  # start a colocated instance too
    placement: Placement = field(default_factory=Placement)
    lease_s: float = bounded(SECONDS, 30.0)
    request_timeout_s: float = bounded(SECONDS, 120.0)
    max_model_len: int | None = bounded(int_range(1, MAX_TOKENS, allow_none=True), None)
    progress_thread: bool = True  # NIXL progress thread on P and D (the serve default)
    transfer_mode: str = "pull"  # pull: D READs; push: P WRITEs into the blocks D announces

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class Cluster:
    spec: ClusterSpec
    log_dir: Path
    services: list[Service] = field(default_factory=list)
    proxy: Service | None = None
    prefill: Service | None = None
    decode: Service | None = None
    colocated: Service | None = None
    # Connector side channels of P and D: service name -> (engine id, KV port)
    connectors: dict[str, tuple[str, int]] = field(default_factory=dict)
    secret: str = field(default_factory=new_secret)  # shared by P and D of this deployment

    def stop(self, timeout_s: float = 15.0) -> None:
        stop_all(self.services, timeout_s)

    def instances(self) -> list[Service]:
        """The engine instances (not the proxy)."""
        return [s for s in (self.prefill, self.decode, self.colocated) if s is not None]


def _serve_args(spec: ClusterSpec, role: str, port: int, tp: int, threads: int,
                connectors: dict[str, tuple[str, int]]) -> list[str]:
    args = ["serve", "--role", role, "--model", spec.model, "--port", str(port), "--tp", str(tp),
            "--num-blocks", str(spec.num_blocks), "--block-size", str(spec.block_size),
            "--threads", str(threads), "--lease-s", str(spec.lease_s),
            "--request-timeout-s", str(spec.request_timeout_s)]
    if spec.max_model_len:
        args += ["--max-model-len", str(spec.max_model_len)]
    if role != "both":
        args.append("--progress-thread" if spec.progress_thread else "--no-progress-thread")
        # With TP, rank r listens on kv_port + r; a free port and its next ones are very likely free.
        engine_id, kv_port = f"{role}-{port}", free_port()
        connectors[role] = (engine_id, kv_port)
        args += ["--kv-port", str(kv_port), "--engine-id", engine_id, "--transfer-mode", spec.transfer_mode]
    return args


def start_cluster(spec: ClusterSpec, log_dir: Path, progress: Progress = print,
                  timeout_s: float = 240.0) -> Cluster:
    """Start what `spec` asks for and wait until every process is healthy; on any failure
    everything already started is stopped before the error propagates."""
    cluster = Cluster(spec, log_dir)
    place = spec.placement
    try:
        if spec.pd:
            p_port, d_port, x_port = free_port(), free_port(), free_port()
            cluster.prefill = start_service(
                "prefill", _serve_args(spec, "prefill", p_port, spec.prefill_tp, place.threads_per_rank,
                                       cluster.connectors),
                p_port, log_dir, env={SECRET_ENV: cluster.secret}, cpus=place.prefill_cpus)
            cluster.services.append(cluster.prefill)
            cluster.decode = start_service(
                "decode", _serve_args(spec, "decode", d_port, spec.decode_tp, place.threads_per_rank,
                                      cluster.connectors),
                d_port, log_dir, env={SECRET_ENV: cluster.secret}, cpus=place.decode_cpus)
            cluster.services.append(cluster.decode)
            cluster.proxy = start_service(
                "proxy", ["proxy", "--prefill", cluster.prefill.url, "--decode", cluster.decode.url,
                          "--port", str(x_port), "--timeout-s", str(spec.request_timeout_s)],
                x_port, log_dir)
            cluster.services.append(cluster.proxy)
        if spec.colocated:
            c_port = free_port()
            cluster.colocated = start_service(
                "colocated", _serve_args(spec, "both", c_port, 1, place.colocated_threads, cluster.connectors), c_port,
                log_dir, cpus=place.colocated_cpus)
            cluster.services.append(cluster.colocated)
        what = ", ".join(s.name for s in cluster.services)
        progress(f"starting {what} ({spec.model}, P tp={spec.prefill_tp}, D tp={spec.decode_tp}); "
                 f"logs in {log_dir}")
        wait_healthy(cluster.services, timeout_s, progress)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextlib.contextmanager
def running_cluster(spec: ClusterSpec, log_dir: Path | None = None, progress: Progress = print,
                    timeout_s: float = 240.0) -> Iterator[Cluster]:
    """`start_cluster` as a context: everything is stopped on exit, Ctrl-C and SIGTERM included."""
    directory = log_dir or Path(tempfile.mkdtemp(prefix="kvlink-"))
    with _sigterm_as_exit():
        cluster = start_cluster(spec, directory, progress, timeout_s)
        try:
            yield cluster
        finally:
            cluster.stop()


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread, so `finally` blocks stop the children."""
    def on_term(signum: int, frame: types.FrameType | None) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def tails(services: Sequence[Service], lines: int = 8) -> str:
    """The last log lines of each service, for error reports."""
    return "\n".join(f"--- {s.name} ({s.log_path}):\n{s.log_tail(lines)}" for s in services)
