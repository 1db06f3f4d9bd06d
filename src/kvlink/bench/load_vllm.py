"""The processes of `kvlink bench load --engine vllm`: vLLM P and D servers with kvlink's connector behind vllm-router.

Every P gets its own block size (by default 32 and 128) and every D 128, so that the
router's pairs include a staged read between block sizes (32 → 128) and whole blocks
(128 → 128). D runs with `kv_load_failure_policy: recompute`, integrity checks at their
default. Every P runs on one core and every D on the other (the process's affinity and
vLLM's OMP binding), so that each P → D pair crosses cores: a P holding a lease keeps its
engine stepping and vLLM's worker busy-polls meanwhile (docs/vllm.md, CPU use). Each
server also serves kvlink's worker endpoint (`metrics_port`) for what it holds now.
vllm-router in front, with a health check every second that takes an instance out at its
first failure. This module starts, kills (SIGKILL by PID), restarts and inspects them;
`load_vllm_run` drives the load.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvlink.bench.instance_state import metric
from kvlink.bench.routers import router_argv, vllm_router_flags
from kvlink.bench.vllm_config import VllmBenchConfig
from kvlink.bench.vllm_servers import start_vllm, wait_servers
from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import kvlink_transfer_config
from kvlink.procs.launcher import (
    Progress,
    Service,
    free_port,
    start_process,
    stop_all,
    wait_healthy,
)
from kvlink.transfer.framing import SECRET_ENV

# What kvlink's worker endpoint (/debug/state) must show as 0 on an idle instance.
HELD = ("leases", "loads_in_flight", "open_transfers", "waiting_for_handshake")
# vLLM's gauges (/metrics) that are 0 on an idle instance.
BUSY = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")
# kvlink counters worth reporting from each worker endpoint.
COUNTERS = ("transfers_total", "failed_transfers_total", "stalled_transfers_total", "expired_leases_total",
            "failed_handshakes_total", "kv_verified_units_total", "kv_checksum_mismatch_total",
            "kv_unsealed_loads_total", "kv_digest_rereads_total", "kv_unverifiable_units_total")


@dataclass(frozen=True)
class FleetConfig:
    model_dir: Path
    log_dir: Path
    prefill_blocks: tuple[int, ...] = (32, 128)
    decode_blocks: tuple[int, ...] = (128, 128)
    prefill_core: int = 0
    decode_core: int = 1
    reference_block: int = 128  # the colocated server's, as D's
    lease_s: float = 15.0  # a lease D never claims (client left before D) ends this soon
    max_model_len: int = 2048
    ready_timeout_s: float = 600.0
    health_check_interval_s: int = 1
    verify_kv: str | None = None  # off | sample | full; None: the connector's default (sample)


@dataclass
class Instance:
    """One vLLM server of the fleet: its fixed ports (kept across restarts) and current process."""

    name: str
    role: str  # prefill | decode
    block_size: int
    core: int
    port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    service: Service | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def worker_url(self) -> str:
        """kvlink's endpoint in the server's (only) worker."""
        return f"http://127.0.0.1:{self.metrics_port}"


class Fleet:
    """The fleet's servers and router; every process started is stopped by `stop`."""

    def __init__(self, config: FleetConfig, progress: Progress = print) -> None:
        self.config = config
        self.progress = progress
        self.secret = new_secret()  # every P and D: signs P's params, authenticates handshakes
        # Eager, as `kvlink bench vllm --enforce-eager`: the compile cache does not reload here.
        self.bench = VllmBenchConfig(model_dir=config.model_dir, max_model_len=config.max_model_len,
                                     enforce_eager=True, log_dir=config.log_dir)
        self.instances = [Instance(f"prefill{i}", "prefill", b, config.prefill_core)
                          for i, b in enumerate(config.prefill_blocks)]
        self.instances += [Instance(f"decode{i}", "decode", b, config.decode_core)
                           for i, b in enumerate(config.decode_blocks)]
        self.router: Service | None = None
        self.router_port, self.router_metrics_port = free_port(), free_port()
        self.started: list[Service] = []  # every process ever started here, killed ones too

    def instance(self, name: str) -> Instance:
        for inst in self.instances:
            if inst.name == name:
                return inst
        raise KeyError(f"no instance {name!r}; the fleet has {', '.join(i.name for i in self.instances)}")

    def roles(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    # ---- processes ----------------------------------------------------------------------
    def kv_config(self, inst: Instance) -> dict[str, Any]:
        extra: dict[str, Any] = {} if self.config.verify_kv is None else {"verify_kv": self.config.verify_kv}
        config = kvlink_transfer_config(inst.side_channel_port, lease_s=self.config.lease_s,
                                        metrics_port=inst.metrics_port, **extra)
        if inst.role == "decode":
            config["kv_load_failure_policy"] = "recompute"
        return config

    def launch(self, inst: Instance) -> Service:
        """Start `inst` (same ports every time; a fresh vLLM engine id); no wait."""
        inst.starts += 1
        label = inst.name if inst.starts == 1 else f"{inst.name}-{inst.starts}"
        inst.service = start_vllm(self.bench, label, inst.port, inst.block_size, inst.core, self.config.log_dir,
                                  self.kv_config(inst), {SECRET_ENV: self.secret})
        self.started.append(inst.service)
        return inst.service

    def launch_reference(self, core: int) -> Service:
        """vLLM colocated: the same model and flags, no connector, D's block size."""
        svc = start_vllm(self.bench, "colocated", free_port(), self.config.reference_block, core,
                         self.config.log_dir, None, {})
        self.started.append(svc)
        return svc

    def wait(self, services: list[Service]) -> None:
        wait_servers(services, self.config.ready_timeout_s, self.progress)

    def start_router(self, timeout_s: float = 60.0) -> Service:
        """vllm-router in front of every P and D, then until it counts every one healthy."""
        every = self.config.health_check_interval_s
        argv = router_argv("vllm-router", [i.url for i in self.roles("prefill")],
                           [i.url for i in self.roles("decode")], self.router_port, 300.0,
                           vllm_router_flags("round_robin", every, 1), metrics_port=self.router_metrics_port)
        self.router = start_process("router", argv, f"http://127.0.0.1:{self.router_port}", self.config.log_dir)
        self.started.append(self.router)
        wait_healthy([self.router], timeout_s, self.progress)
        self.wait_health(lambda seen: all(seen.values()), timeout_s, "every instance healthy in vllm-router")
        return self.router

    def kill(self, name: str) -> int:
        """SIGKILL the server's process group (API server, engine core, worker); returns its PID."""
        svc = self.instance(name).service
        if svc is None:
            raise RuntimeError(f"{name} is not running")
        os.killpg(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(timeout=10)
        return svc.proc.pid

    def stop(self) -> None:
        stop_all(self.started, timeout_s=20.0)

    # ---- what the router and the instances say ------------------------------------------
    def router_health(self) -> dict[str, bool]:
        """vllm-router's view: instance URL -> in rotation."""
        assert self.router is not None, "start_router first"
        workers = httpx.get(self.router.url + "/workers", timeout=5.0).json()["workers"]
        return {str(w["url"]): bool(w["is_healthy"]) for w in workers}

    def wait_health(self, done: Any, timeout_s: float, what: str) -> float:
        """Poll `router_health` until `done(health)`; returns the time it first held (monotonic)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if done(self.router_health()):
                    return time.monotonic()
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not seen within {timeout_s:.0f}s")
            time.sleep(0.1)

    def held(self, inst: Instance) -> dict[str, float]:
        """vLLM's busy gauges and what kvlink's worker holds; all 0 when idle."""
        out = {name: metric(inst.url, name) for name in BUSY}
        state = httpx.get(inst.worker_url + "/debug/state", timeout=5.0).json()
        return {**out, **{name: float(state.get(name, 0)) for name in HELD}}

    def wait_idle(self, timeout_s: float) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Until every instance is idle: (seconds until idle, what each still held at the deadline)."""
        started = time.monotonic()
        took: dict[str, float] = {}
        last: dict[str, dict[str, float]] = {}
        while len(took) < len(self.instances):
            for inst in self.instances:
                if inst.name in took:
                    continue
                try:
                    held = {k: v for k, v in self.held(inst).items() if v}
                except (httpx.HTTPError, ValueError) as error:
                    held = {f"unreachable: {error!r}": 1.0}
                if held:
                    last[inst.name] = held
                else:
                    took[inst.name] = time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                break
            time.sleep(0.25)
        return took, {name: held for name, held in last.items() if name not in took}

    def counters(self, inst: Instance) -> dict[str, float]:
        """kvlink's counters of the worker (since its last start) and vLLM's finished requests."""
        out = {name: metric(inst.worker_url, f"kvlink_{name}") for name in COUNTERS}
        out["vllm_requests_finished"] = metric(inst.url, "request_success_total")
        return out

    def pids(self) -> dict[str, int]:
        """Every process to sample: each server's API server, engine core and worker, and the router."""
        out: dict[str, int] = {}
        for inst in self.instances:
            if inst.service is not None:
                out.update({f"{inst.name} {part}": pid for part, pid in server_processes(inst.service).items()})
        if self.router is not None:
            out["router"] = self.router.proc.pid
        return out


def server_processes(svc: Service) -> dict[str, int]:
    """A vLLM server's processes by part (api, engine, worker), from /proc; vLLM names its
    children by process title (`VLLM::EngineCore`, `VLLM::Worker...`)."""
    out = {"api": svc.proc.pid}
    pending = [svc.proc.pid]
    while pending:
        pid = pending.pop()
        for child in _children(pid):
            pending.append(child)
            title = _title(child)
            for part, marker in (("worker", "Worker"), ("engine", "EngineCore")):
                if marker in title:
                    out.setdefault(part, child)
    return out


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass  # gone: nothing to sample
    return found


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
