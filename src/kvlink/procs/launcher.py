"""Start, watch and stop local kvlink processes (servers, proxy) by PID with bounded waits."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvlink.procs.shm import remove_orphans

Progress = Callable[[str], None]
"""Where a long wait reports how it goes, a line at a time (print by default)."""

# Ports this process has handed out: never twice, so two children started back to back
# cannot be given the same one before either has bound it.
_handed_out: set[int] = set()
# Where listen ports are drawn from: clear of the fixed ports kvlink's tests and benches use
# (side channels 5600-5899, vLLM test servers 18300-18399, vllm-router metrics 29000).
_LISTEN_RANGE = (20000, 28900)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _all_free(base: int, span: int) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in range(base, base + span):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port(span: int = 1, tries: int = 500) -> int:
    """A loopback port (the first of `span` consecutive ones) free now, for a child to listen on.

    It is drawn from below the kernel's ephemeral range: a port probed free there and bound a
    few seconds later by a starting child could meanwhile become the local end of some
    outgoing connection (UCX opens many). Ports already handed out by this process are
    skipped. Falls back to a kernel-chosen port when that range is too small."""
    ephemeral_low, ephemeral_high = _ephemeral_range()
    low, high = _LISTEN_RANGE
    ranges = [(lo, hi) for lo, hi in ((low, min(high, ephemeral_low)), (max(low, ephemeral_high + 1), 65536))
              if hi - lo > 2 * span + 100]
    for _ in range(tries):
        if not ranges:
            break
        lo, hi = random.choice(ranges)
        base = random.randrange(lo, hi - span)
        wanted = set(range(base, base + span))
        if wanted & _handed_out or not _all_free(base, span):
            continue
        _handed_out.update(wanted)
        return base
    if span == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    raise RuntimeError(f"no {span} consecutive free loopback ports found in {tries} tries")


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    started: float = field(default_factory=time.time)  # epoch seconds, for `stop_all`'s sweep

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
                  env: dict[str, str] | None = None, cpus: Sequence[int] | None = None,
                  cwd: Path | None = None) -> Service:
    """Run `argv` in its own process group (from `cwd`, default this process's), output to
    `log_dir/<name>.log`; it will answer at `url`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
                "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                cwd=cwd, start_new_session=True)
    if cpus:
        # Set before the interpreter has started any thread; later threads and children inherit it.
        try:
            os.sched_setaffinity(proc.pid, set(cpus))
        except ProcessLookupError:
            pass  # it exited already: waiting on it reports that, with its log
        except OSError:  # no such core: the child must not run on, unpinned and unowned
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=5)
            raise
    return Service(name, proc, url, log_path)


def run_logged(name: str, argv: Sequence[str], log_dir: Path, timeout_s: float,
               env: dict[str, str] | None = None, cwd: Path | None = None) -> Service:
    """Run a command that serves nothing (a client) to its end, like `start_process`; returns it
    finished. Raises TimeoutError past `timeout_s`; stopped by group if the wait is cut short."""
    svc = start_process(name, argv, "", log_dir, env, cwd=cwd)
    try:
        svc.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_all([svc], timeout_s=5.0)
        raise TimeoutError(f"{name} still running after {timeout_s:.0f}s; log {svc.log_path}:\n"
                           f"{svc.log_tail()}") from None
    except BaseException:
        stop_all([svc], timeout_s=5.0)
        raise
    return svc


def _answers_health(client: httpx.Client, svc: Service) -> bool:
    return client.get(svc.url + "/health").status_code == 200


def wait_healthy(services: Sequence[Service], timeout_s: float,
                 progress: Progress = print,
                 is_ready: Callable[[httpx.Client, Service], bool] = _answers_health,
                 tail_lines: int = 20, report_every_s: float = 5.0) -> dict[str, float]:
    """Poll each service until `is_ready` (default: /health answers 200); fail fast, with the
    log tail, if one exits. Returns the seconds each took."""
    started = time.monotonic()
    pending = list(services)
    ready: dict[str, float] = {}
    last_report = 0.0
    with httpx.Client(timeout=2.0) as client:
        while pending:
            elapsed = time.monotonic() - started
            for svc in list(pending):
                if svc.proc.poll() is not None:
                    raise RuntimeError(f"{svc.name} exited with code {svc.proc.returncode} after "
                                       f"{elapsed:.0f}s; log {svc.log_path}:\n{svc.log_tail(tail_lines)}")
                try:
                    if is_ready(client, svc):
                        pending.remove(svc)
                        ready[svc.name] = elapsed
                        progress(f"  {svc.name} ready after {elapsed:.1f}s ({svc.url})")
                except (httpx.HTTPError, ValueError):
                    pass
            if not pending:
                break
            if elapsed > timeout_s:
                names = ", ".join(s.name for s in pending)
                raise TimeoutError(f"{names} not ready after {timeout_s:.0f}s; log {pending[0].log_path}:\n"
                                   f"{pending[0].log_tail(tail_lines)}")
            if elapsed - last_report >= report_every_s:
                last_report = elapsed
                progress(f"  waiting for {', '.join(s.name for s in pending)} {elapsed:.0f}s")
            time.sleep(0.2)
    return ready


def stop_all(services: Sequence[Service], timeout_s: float = 15.0,
             straggler_grace_s: float = 0.5) -> None:
    """SIGTERM each process group, wait up to `timeout_s` for the leaders, then SIGKILL what is
    left of each group (after `straggler_grace_s` for members still exiting). Then unlink the
    shared-memory segments created since the first of them started that no live process uses
    (`kvlink.procs.shm`: vLLM's, which a stopped server leaves behind)."""
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
    # A member may outlive its leader (vLLM's engine core, a TP follower); one that is a zombie
    # nobody reaps keeps the group "alive", hence a bounded grace rather than a wait.
    grace_end = time.monotonic() + straggler_grace_s
    for svc in services:
        while _group_alive(svc.proc.pid) and time.monotonic() < grace_end:
            time.sleep(0.05)
        if _group_alive(svc.proc.pid):  # the group id cannot have been reused while it has members
            _signal_group(svc.proc, signal.SIGKILL)
    if services:  # what their processes left in /dev/shm that nobody alive maps (vLLM's queues)
        remove_orphans(since=min(svc.started for svc in services))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member exists, whoever it now runs as
        pass
    return True


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
