"""A local 1P1D cluster (prefill, decode, proxy, optional colocated reference) for load and fault runs.

Every process is started in its own process group and stopped by PID with bounded
waits (`kvlink.procs.launcher`). P and D share a secret made for this cluster (in their
environment, not on their command lines), kept across restarts. `leaks()` reads
`/debug/state` of an instance and names everything still held: busy blocks, leases,
loads in flight, open transfers.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvlink.connector.secret import SECRET_ENV, new_secret
from kvlink.layout.limits import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    SECONDS,
    SECONDS_OR_ZERO,
    THREADS,
    bounded,
    check_fields,
)
from kvlink.procs.launcher import Service, free_port, start_service, stop_all, wait_healthy

Progress = Callable[[str], None]


@dataclass
class ClusterConfig:
    model: str = "tiny-hybrid"
    num_blocks: int = bounded(NUM_BLOCKS, 64)
    block_size: int = bounded(BLOCK_SIZE, 16)
    lease_s: float = bounded(SECONDS, 30.0)
    stall_timeout_s: float = bounded(SECONDS, 10.0)
    quarantine_s: float = bounded(SECONDS_OR_ZERO, 60.0)
    load_failure_policy: str = "recompute"
    request_timeout_s: float = bounded(SECONDS, 60.0)
    proxy_timeout_s: float = bounded(SECONDS, 60.0)
    threads: int = bounded(THREADS, 1)
    reference: bool = False  # also start a colocated `--role both` instance for expected texts
    env: dict[str, str] = field(default_factory=dict)  # extra env for P and D (e.g. UCX_TLS=tcp)
    prefill_env: dict[str, str] = field(default_factory=dict)  # on top of `env`, P only
    decode_env: dict[str, str] = field(default_factory=dict)  # on top of `env`, D only
    prefill_host: str = "127.0.0.1"
    decode_host: str = "127.0.0.1"
    prefill_netns: str | None = None  # run P inside this network namespace (`ip netns exec`)
    decode_netns: str | None = None
    extra_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)  # on top of extra_args, P only (e.g. --tp 2)

    def __post_init__(self) -> None:
        check_fields(self)


class Cluster:
    """P, D and the proxy (and a reference instance) on free local ports; restartable pieces."""

    def __init__(self, config: ClusterConfig, log_dir: Path, progress: Progress = print) -> None:
        self.config = config
        self.log_dir = log_dir
        self.progress = progress
        self.p_port, self.d_port, self.x_port = free_port(), free_port(), free_port()
        self.kv_port = free_port()
        self.ref_port = free_port()
        self.engine_id = f"P-{os.getpid()}-{self.p_port}"
        self.secret = new_secret()  # signs P's kv_transfer_params, authenticates handshakes
        self.prefill: Service | None = None
        self.decode: Service | None = None
        self.proxy: Service | None = None
        self.reference: Service | None = None
        self._starts: dict[str, int] = {}

    # ---- processes ----------------------------------------------------------------------
    def _common(self) -> list[str]:
        c = self.config
        return ["--model", c.model, "--threads", str(c.threads), "--num-blocks", str(c.num_blocks),
                "--block-size", str(c.block_size), "--request-timeout-s", str(c.request_timeout_s),
                *c.extra_args]

    def _start(self, name: str, args: list[str], port: int, host: str = "127.0.0.1",
               netns: str | None = None, env: dict[str, str] | None = None) -> Service:
        self._starts[name] = self._starts.get(name, 0) + 1
        log_name = f"{name}-{self._starts[name]}"
        if netns is not None:
            svc = _start_in_netns(log_name, netns, args, self.log_dir, env)
        else:
            svc = start_service(log_name, args, port, self.log_dir, env=env)
        svc.url = f"http://{host}:{port}"
        return svc

    def start_prefill(self) -> Service:
        c = self.config
        self.prefill = self._start("prefill", [
            "serve", "--role", "prefill", "--host", c.prefill_host, "--port", str(self.p_port),
            "--kv-port", str(self.kv_port), "--engine-id", self.engine_id, "--lease-s", str(c.lease_s),
            *self._common(), *c.prefill_args], self.p_port, c.prefill_host, c.prefill_netns,
            {**c.env, SECRET_ENV: self.secret, **c.prefill_env})
        return self.prefill

    def start_decode(self) -> Service:
        c = self.config
        self.decode = self._start("decode", [
            "serve", "--role", "decode", "--host", c.decode_host, "--port", str(self.d_port),
            "--kv-port", "0", "--engine-id", f"D-{os.getpid()}-{self.d_port}",
            "--stall-timeout-s", str(c.stall_timeout_s), "--lease-s", str(c.lease_s),
            "--quarantine-s", str(c.quarantine_s),
            "--load-failure-policy", c.load_failure_policy, *self._common()],
            self.d_port, c.decode_host, c.decode_netns, {**c.env, SECRET_ENV: self.secret, **c.decode_env})
        return self.decode

    def start_proxy(self) -> Service:
        assert self.prefill is not None and self.decode is not None
        self.proxy = self._start("proxy", [
            "proxy", "--prefill", self.prefill.url, "--decode", self.decode.url,
            "--port", str(self.x_port), "--timeout-s", str(self.config.proxy_timeout_s)], self.x_port)
        return self.proxy

    def start(self, timeout_s: float = 180.0) -> None:
        services = [self.start_prefill(), self.start_decode(), self.start_proxy()]
        if self.config.reference:
            self.reference = self._start("reference", [
                "serve", "--role", "both", "--port", str(self.ref_port), *self._common()], self.ref_port)
            services.append(self.reference)
        try:
            wait_healthy(services, timeout_s, self.progress)
        except Exception:
            self.stop()
            raise

    def restart(self, which: str, timeout_s: float = 120.0) -> Service:
        """Stop (if still running) and start again `prefill`, `decode` or `proxy`, same ports and ids."""
        old = getattr(self, which)
        if old is not None:
            stop_all([old], timeout_s=10)
        svc = {"prefill": self.start_prefill, "decode": self.start_decode, "proxy": self.start_proxy}[which]()
        wait_healthy([svc], timeout_s, self.progress)
        return svc

    def services(self) -> list[Service]:
        return [s for s in (self.proxy, self.decode, self.prefill, self.reference) if s is not None]

    def stop(self) -> None:
        stop_all(self.services(), timeout_s=10)

    def signal(self, which: str, sig: signal.Signals) -> None:
        svc = getattr(self, which)
        assert svc is not None, f"{which} is not running"
        os.killpg(svc.proc.pid, sig)
        if sig == signal.SIGKILL:
            svc.proc.wait(timeout=10)

    # ---- state --------------------------------------------------------------------------
    def state(self, which: str, timeout_s: float = 5.0) -> dict[str, Any]:
        svc = getattr(self, which)
        assert svc is not None
        answer: dict[str, Any] = httpx.get(svc.url + "/debug/state", timeout=timeout_s).json()
        return answer


def leaks(state: dict[str, Any], num_blocks: int) -> list[str]:
    """What an idle instance still holds, from its `/debug/state`; empty when clean."""
    engine = state.get("engine", {})
    found = []
    if state.get("in_flight"):
        found.append(f"{state['in_flight']} requests in flight")
    for name in ("running", "waiting", "waiting_for_remote_kv", "held_requests"):
        if engine.get(name):
            found.append(f"{name}={engine[name]}")
    free = engine.get("free_blocks", [])
    if any(f != num_blocks for f in free):
        found.append(f"free blocks {free}, expected {num_blocks} per group")
    connector = engine.get("connector") or {}
    for name in ("leases", "loads_in_flight", "open_transfers", "waiting_for_handshake"):
        if connector.get(name):
            found.append(f"{name}={connector[name]}")
    return found


def metric(url: str, name: str) -> float:
    """Sum of every sample in `url`/metrics of the Prometheus metrics whose name ends with `name`."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if match and match.group(1).endswith(name):
            total += float(match.group(3))
    return total


def wait_clean(urls: Sequence[str], num_blocks: int, timeout_s: float) -> dict[str, float]:
    """Poll each instance's `/debug/state` until nothing is held; returns seconds until clean.

    Raises AssertionError naming what is still held at the deadline.
    """
    started = time.monotonic()
    took: dict[str, float] = {}
    last: dict[str, list[str]] = {}
    with httpx.Client(timeout=5.0) as client:
        while True:
            for url in urls:
                if url in took:
                    continue
                try:
                    found = leaks(client.get(url + "/debug/state").json(), num_blocks)
                except httpx.HTTPError as error:
                    found = [f"/debug/state unreachable: {error!r}"]
                if found:
                    last[url] = found
                else:
                    took[url] = time.monotonic() - started
            if len(took) == len(urls):
                return took
            if time.monotonic() - started > timeout_s:
                held = {u: last.get(u) for u in urls if u not in took}
                raise AssertionError(f"instances still hold state after {timeout_s:.0f}s: {held}")
            time.sleep(0.1)


def _start_in_netns(name: str, netns: str, args: Sequence[str], log_dir: Path,
                    env: dict[str, str] | None) -> Service:
    import subprocess
    import sys

    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-m", "kvlink.cli.main",
                                 *args], stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    return Service(name, proc, "", log_path)
