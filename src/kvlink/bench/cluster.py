"""One local P/D deployment for the demo, the benchmarks and the tests.

N prefill and M decode instances, a router in front of them (kvlink's proxy or
vllm-router, `kvlink.bench.routers`) and, optionally, a colocated instance to compare
against. Every process gets free loopback ports (or runs inside a network namespace),
its own process group and log file, and is stopped by PID with bounded waits
(`kvlink.procs.launcher`). P and D share one secret made for this deployment, passed in
their environment (never on a command line); the secret, every port and every engine id
stay the same across restarts, so a restarted P is the same engine to D.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvlink.bench.placement import Placement
from kvlink.bench.routers import ROUTER_KINDS, router_argv
from kvlink.connector.secret import new_secret
from kvlink.layout.limits import (
    BLOCK_SIZE,
    MAX_SECONDS,
    MAX_TOKENS,
    NUM_BLOCKS,
    SECONDS,
    SECONDS_OR_ZERO,
    TP,
    bounded,
    check_fields,
    float_range,
    int_range,
)
from kvlink.procs.launcher import (
    Progress,
    Service,
    free_port,
    start_process,
    start_service,
    stop_all,
    wait_healthy,
)
from kvlink.transfer.framing import SECRET_ENV

INSTANCES = int_range(1, 64)  # P (or D) instances of one local deployment


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. `pd` starts the P and D instances and the router; `colocated` a
    `--role both` instance for expected answers (TP 1, P's block size, no secret)."""

    model: str = "smollm2-135m"
    n_prefill: int = bounded(INSTANCES, 1)
    n_decode: int = bounded(INSTANCES, 1)
    prefill_tp: int = bounded(TP, 1)
    decode_tp: int = bounded(TP, 1)
    num_blocks: int = bounded(NUM_BLOCKS, 128)
    prefill_block_size: int = bounded(BLOCK_SIZE, 16)
    decode_block_size: int = bounded(BLOCK_SIZE, 16)
    transfer_mode: str = "pull"  # pull: D READs; push: P WRITEs into the blocks D announces
    pd: bool = True
    colocated: bool = False
    router: str = "kvlink"  # or "vllm-router"
    router_args: Sequence[str] = ()  # after the router's own (e.g. `routers.vllm_router_flags(...)`)
    placement: Placement = field(default_factory=Placement)
    lease_s: float = bounded(SECONDS, 30.0)
    stall_timeout_s: float = bounded(SECONDS, 10.0)  # D only
    quarantine_s: float = bounded(SECONDS_OR_ZERO, 60.0)  # D only
    load_failure_policy: str = "fail"  # D only; the serve default
    request_timeout_s: float = bounded(SECONDS, 120.0)
    router_timeout_s: float | None = bounded(float_range(1e-3, MAX_SECONDS, allow_none=True), None)
    max_model_len: int | None = bounded(int_range(1, MAX_TOKENS, allow_none=True), None)
    progress_thread: bool = True  # NIXL progress thread on P and D (the serve default)
    serve_args: Sequence[str] = ()  # extra `kvlink serve` arguments, every instance
    prefill_args: Sequence[str] = ()  # on top of serve_args, P only (e.g. --tp-step-timeout-s 4)
    decode_args: Sequence[str] = ()  # on top of serve_args, D only
    env: dict[str, str] = field(default_factory=dict)  # extra environment of P and D (UCX_TLS=tcp)
    prefill_env: dict[str, str] = field(default_factory=dict)  # on top of env, P only
    decode_env: dict[str, str] = field(default_factory=dict)  # on top of env, D only
    prefill_host: str = "127.0.0.1"  # where P listens and is reached
    decode_host: str = "127.0.0.1"
    prefill_netns: str | None = None  # run P inside this network namespace (`ip netns exec`)
    decode_netns: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        for option, value, allowed in (("transfer_mode", self.transfer_mode, ("pull", "push")),
                                       ("router", self.router, ROUTER_KINDS),
                                       ("load_failure_policy", self.load_failure_policy,
                                        ("fail", "recompute"))):
            if value not in allowed:
                raise ValueError(f"{option}: expected one of {', '.join(allowed)}; got {value!r}")
        if not self.pd and not self.colocated:
            raise ValueError("ClusterSpec starts nothing: set pd=True, colocated=True or both")


@dataclass
class Member:
    """One engine instance: how it is started (kept across restarts) and its current process."""

    name: str  # "prefill", "prefill1", ..., "decode", ..., "colocated"
    role: str  # prefill | decode | both
    port: int
    kv_port: int | None  # connector side channel (rank r listens on kv_port + r)
    engine_id: str | None
    args: list[str]  # `kvlink` arguments
    extra_args: list[str] = field(default_factory=list)  # after `args`, set by `Cluster.restart`
    host: str = "127.0.0.1"
    netns: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None
    service: Service | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Cluster:
    """The processes of one `ClusterSpec`; pieces can be signalled, restarted and inspected by name."""

    def __init__(self, spec: ClusterSpec, log_dir: Path, progress: Progress = print) -> None:
        self.spec = spec
        self.log_dir = log_dir
        self.progress = progress
        self.secret = new_secret()  # signs P's kv_transfer_params, authenticates handshakes
        # free_port never hands out a port (or one inside a TP rank's span) twice per process.
        self.members: list[Member] = []
        if spec.pd:
            self.members += [self._engine(spec, "prefill", i) for i in range(spec.n_prefill)]
            self.members += [self._engine(spec, "decode", i) for i in range(spec.n_decode)]
        if spec.colocated:
            port = free_port()
            self.members.append(Member(
                "colocated", "both", port, None, None,
                _serve_args(spec, "both", port, "127.0.0.1", 1, spec.placement.colocated_threads,
                            spec.prefill_block_size), cpus=spec.placement.colocated_cpus))
        self.proxy: Service | None = None
        self.proxy_port = free_port()
        self.router_metrics_port = free_port()  # vllm-router's Prometheus listener
        self.extra_routers: list[Service] = []  # `add_router`: more routers on the same instances
        self._proxy_starts = 0
        # Built now: a missing vllm-router is reported before any process starts.
        self._router_argv = self._router_command(spec.router_args) if spec.pd else None

    def _router_command(self, router_args: Sequence[str], kind: str | None = None, port: int | None = None,
                        metrics_port: int | None = None) -> list[str]:
        """The command line of a router of `kind` (default: the spec's) in front of every P and D,
        on `port` (default: the proxy port) with vllm-router's metrics on `metrics_port`."""
        spec = self.spec
        kind = spec.router if kind is None else kind
        if port is None:
            port, metrics_port = self.proxy_port, self.router_metrics_port
        return router_argv(kind, [m.url for m in self.roles("prefill")],
                           [m.url for m in self.roles("decode")], port,
                           spec.router_timeout_s or spec.request_timeout_s, router_args,
                           metrics_port=metrics_port if kind == "vllm-router" else None)

    def set_router_args(self, router_args: Sequence[str]) -> None:
        """Replace the router's extra arguments (`spec.router_args`) from its next (re)start on."""
        if self._router_argv is None:
            raise ValueError("this cluster has no router: its spec has pd=False")
        self._router_argv = self._router_command(router_args)

    def _engine(self, spec: ClusterSpec, role: str, index: int) -> Member:
        prefill = role == "prefill"
        name = role if index == 0 else f"{role}{index}"
        tp = spec.prefill_tp if prefill else spec.decode_tp
        host = spec.prefill_host if prefill else spec.decode_host
        port, kv_port = free_port(), free_port(tp)
        engine_id = f"{name}-{os.getpid()}-{port}"
        args = _serve_args(spec, role, port, host, tp, spec.placement.threads_per_rank,
                           spec.prefill_block_size if prefill else spec.decode_block_size)
        args += ["--kv-port", str(kv_port), "--engine-id", engine_id, "--transfer-mode", spec.transfer_mode,
                 "--progress-thread" if spec.progress_thread else "--no-progress-thread"]
        if not prefill:
            args += ["--stall-timeout-s", str(spec.stall_timeout_s), "--quarantine-s", str(spec.quarantine_s),
                     "--load-failure-policy", spec.load_failure_policy]
        args += [*(spec.prefill_args if prefill else spec.decode_args)]
        env = {**spec.env, SECRET_ENV: self.secret, **(spec.prefill_env if prefill else spec.decode_env)}
        return Member(name, role, port, kv_port, engine_id, args, host=host,
                      netns=spec.prefill_netns if prefill else spec.decode_netns, env=env,
                      cpus=spec.placement.prefill_cpus if prefill else spec.placement.decode_cpus)

    # ---- lookups ------------------------------------------------------------------------
    def roles(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]

    def member(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(f"no instance {name!r} in this cluster; it has "
                       f"{', '.join(m.name for m in self.members)}")

    def _first(self, role: str) -> Service | None:
        found = self.roles(role)
        return found[0].service if found else None

    @property
    def prefill(self) -> Service | None:
        return self._first("prefill")

    @property
    def decode(self) -> Service | None:
        return self._first("decode")

    @property
    def colocated(self) -> Service | None:
        return self._first("both")

    def instances(self) -> list[Service]:
        """The engine instances that are started (not the router)."""
        return [m.service for m in self.members if m.service is not None]

    def services(self) -> list[Service]:
        return [*self.instances(), *([self.proxy] if self.proxy is not None else []), *self.extra_routers]

    def service(self, which: str) -> Service:
        svc = self.proxy if which == "proxy" else self.member(which).service
        if svc is None:
            raise RuntimeError(f"{which} is not running")
        return svc

    # ---- processes ----------------------------------------------------------------------
    def _start_member(self, m: Member) -> Service:
        m.starts += 1
        log_name = m.name if m.starts == 1 else f"{m.name}-{m.starts}"
        prefix = ("ip", "netns", "exec", m.netns) if m.netns else ()
        m.service = start_service(log_name, [*m.args, *m.extra_args], m.port, self.log_dir, env=m.env, cpus=m.cpus,
                                  host=m.host, prefix=prefix)
        return m.service

    def _start_proxy(self) -> Service:
        if self._router_argv is None:
            raise ValueError("this cluster has no proxy: its spec has pd=False")
        self._proxy_starts += 1
        log_name = "proxy" if self._proxy_starts == 1 else f"proxy-{self._proxy_starts}"
        self.proxy = start_process(log_name, self._router_argv, f"http://127.0.0.1:{self.proxy_port}",
                                   self.log_dir)
        return self.proxy

    def add_router(self, kind: str, timeout_s: float = 60.0) -> Service:
        """Start one more router of `kind` in front of the same P and D instances, on its own
        port (to compare routers on one deployment); `stop` stops it with the rest."""
        port = free_port()
        metrics_port = free_port() if kind == "vllm-router" else None
        argv = self._router_command((), kind, port, metrics_port)
        svc = start_process(f"router-{len(self.extra_routers) + 1}-{kind}", argv, f"http://127.0.0.1:{port}",
                            self.log_dir)
        self.extra_routers.append(svc)
        wait_healthy([svc], timeout_s, self.progress)
        return svc

    def start(self, timeout_s: float = 240.0) -> None:
        """Start everything and wait until every process is healthy; on any failure everything
        already started is stopped before the error propagates."""
        try:
            started = [self._start_member(m) for m in self.members]
            if self._router_argv is not None:
                started.append(self._start_proxy())
            s = self.spec
            self.progress(f"starting {', '.join(svc.name for svc in started)} ({s.model}, "
                          f"P tp={s.prefill_tp}, D tp={s.decode_tp}); logs in {self.log_dir}")
            wait_healthy(started, timeout_s, self.progress)
        except BaseException:
            self.stop()
            raise

    def restart(self, which: str, timeout_s: float = 120.0, extra_args: Sequence[str] | None = None) -> Service:
        """Stop (if still running) and start again `proxy` or an instance: same ports, ids, secret.

        `extra_args` (instances only) replaces the `kvlink serve` arguments added after the
        instance's own, for this start and the later ones; `[]` drops them again.
        """
        old = self.proxy if which == "proxy" else self.member(which).service
        if extra_args is not None:
            if which == "proxy":
                raise ValueError("restart: extra_args are `kvlink serve` arguments; the proxy takes none")
            self.member(which).extra_args = list(extra_args)
        if old is not None:
            stop_all([old], timeout_s=10)
        svc = self._start_proxy() if which == "proxy" else self._start_member(self.member(which))
        wait_healthy([svc], timeout_s, self.progress)
        return svc

    def stop(self, timeout_s: float = 15.0) -> None:
        stop_all(self.services(), timeout_s)

    def signal(self, which: str, sig: signal.Signals) -> None:
        svc = self.service(which)
        os.killpg(svc.proc.pid, sig)
        if sig == signal.SIGKILL:
            svc.proc.wait(timeout=10)

    def state(self, which: str, timeout_s: float = 5.0) -> dict[str, Any]:
        """`/debug/state` of an instance."""
        answer: dict[str, Any] = httpx.get(self.service(which).url + "/debug/state", timeout=timeout_s).json()
        return answer


def _serve_args(spec: ClusterSpec, role: str, port: int, host: str, tp: int, threads: int,
                block_size: int) -> list[str]:
    args = ["serve", "--role", role, "--model", spec.model, "--host", host, "--port", str(port),
            "--tp", str(tp), "--num-blocks", str(spec.num_blocks), "--block-size", str(block_size),
            "--threads", str(threads), "--lease-s", str(spec.lease_s),
            "--request-timeout-s", str(spec.request_timeout_s)]
    if spec.max_model_len:
        args += ["--max-model-len", str(spec.max_model_len)]
    return [*args, *spec.serve_args]


@contextlib.contextmanager
def running_cluster(spec: ClusterSpec, log_dir: Path | None = None, progress: Progress = print,
                    timeout_s: float = 240.0) -> Iterator[Cluster]:
    """A started `Cluster` as a context: everything is stopped on exit, Ctrl-C and SIGTERM included."""
    cluster = Cluster(spec, log_dir or Path(tempfile.mkdtemp(prefix="kvlink-")), progress)
    with _sigterm_as_exit():
        cluster.start(timeout_s)
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
