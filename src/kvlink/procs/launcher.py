"""Start, watch and stop local kvlink processes (servers, proxy) by PID with bounded waits."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_service(name: str, args: Sequence[str], port: int, log_dir: Path,
                  env: dict[str, str] | None = None, cpus: Sequence[int] | None = None,
                  host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> Service:
    """Run `kvlink <args>` in its own process group, output to `log_dir/<name>.log`.

    `cpus` pins the process (and the TP followers it starts) to those cores; `prefix`
    goes before the interpreter (e.g. `ip netns exec NS`); the service answers at `host:port`.
    """
    argv = [*prefix, sys.executable, "-m", "kvlink.cli.main", *args]
    return start_process(name, argv, f"http://{host}:{port}", log_dir, env, cpus)


def start_process(name: str, argv: Sequence[str], url: str, log_dir: Path,
                  env: dict[str, str] | None = None, cpus: Sequence[int] | None = None) -> Service:
    """Run `argv` in its own process group, output to `log_dir/<name>.log`; it will answer at `url`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
                "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    if cpus:
        # Set before the interpreter has started any thread; later threads and children inherit it.
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(proc.pid, set(cpus))
    return Service(name, proc, url, log_path)


def wait_healthy(services: Sequence[Service], timeout_s: float,
                 progress: Callable[[str], None] = print) -> None:
    """Poll each service's /health until it answers 200; fail fast if one exits."""
    started = time.monotonic()
    pending = list(services)
    last_report = 0.0
    with httpx.Client(timeout=2.0) as client:
        while pending:
            elapsed = time.monotonic() - started
            for svc in list(pending):
                if svc.proc.poll() is not None:
                    raise RuntimeError(f"{svc.name} exited with code {svc.proc.returncode}:\n{svc.log_tail()}")
                try:
                    if client.get(svc.url + "/health").status_code == 200:
                        pending.remove(svc)
                        progress(f"  {svc.name} ready after {elapsed:.1f}s ({svc.url})")
                except httpx.HTTPError:
                    pass
            if not pending:
                return
            if elapsed > timeout_s:
                names = ", ".join(s.name for s in pending)
                raise TimeoutError(f"{names} not healthy after {timeout_s:.0f}s:\n{pending[0].log_tail()}")
            if elapsed - last_report >= 5.0:
                last_report = elapsed
                progress(f"  waiting for {', '.join(s.name for s in pending)} (loading models) "
                         f"{elapsed:.0f}s")
            time.sleep(0.2)


def stop_all(services: Sequence[Service], timeout_s: float = 15.0) -> None:
    """SIGTERM each process group, wait up to `timeout_s`, then SIGKILL what is left."""
    for svc in services:
        if svc.proc.poll() is None:
            _signal_group(svc.proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for svc in services:
        try:
            svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(svc.proc, signal.SIGKILL)
            svc.proc.wait(timeout=5)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
