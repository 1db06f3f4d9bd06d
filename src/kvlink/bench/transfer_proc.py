"""Driver side of connector peer processes: start, talk JSON lines, wait with deadlines, stop by PID.

A peer is one worker (one TP rank) in its own process (see `transfer_peer`). It answers
each command line `{"id": n, "cmd": ..., ...}` with `{"id": n, "ok": ..., "result"|"error"}`
and reports, unasked, `{"event": "output", ...}` lines for every non-empty
`get_finished()`. A reader thread files replies and events; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

_EOF = object()


class PeerError(RuntimeError):
    """A peer answered with an error, died, or did not answer in time."""


def peer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a peer: loopback-only UCX, unbuffered Python, plus `extra`."""
    env = dict(os.environ)
    env.setdefault("UCX_NET_DEVICES", "lo")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class PeerProcess:
    """One peer process. Aggregates its `output` events into per-request first-seen times."""

    def __init__(self, argv: Sequence[str], name: str, *, env: dict[str, str] | None = None,
                 log_path: Path | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[str] | int = log_path.open("w") if log_path is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=env if env is not None else peer_env(), text=True, bufsize=1,
        )
        self._replies: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.ready: dict[str, Any] | None = None
        self.finished_recving: dict[str, float] = {}
        self.failed_recving: dict[str, float] = {}
        self.finished_sending: dict[str, float] = {}
        self.invalid_block_ids: set[int] = set()
        self.load_failures: dict[str, str] = {}
        self._reader = threading.Thread(target=self._pump, name=f"peer-{name}", daemon=True)
        self._reader.start()

    # ---- reader thread ------------------------------------------------------------------
    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # not ours (a library printing to the protocol stream)
            if not isinstance(msg, dict):
                continue
            if "event" in msg:
                self._on_event(msg)
            elif "id" in msg:
                self._replies.put(msg)
        self._replies.put(_EOF)

    def _on_event(self, msg: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(msg)
            if msg["event"] == "ready":
                self.ready = msg
            elif msg["event"] == "output":
                t = float(msg["t"])
                for key, book in (("finished_recving", self.finished_recving),
                                  ("failed_recving", self.failed_recving),
                                  ("finished_sending", self.finished_sending)):
                    for rid in msg.get(key, []):
                        book.setdefault(rid, t)
                self.invalid_block_ids.update(int(b) for b in msg.get("invalid_block_ids", []))
                for rid, reason in (msg.get("load_failures") or {}).items():
                    self.load_failures.setdefault(rid, str(reason))

    # ---- commands -----------------------------------------------------------------------
    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        self.wait_until(lambda: self.ready is not None, timeout_s, what="ready")
        assert self.ready is not None
        return self.ready

    @property
    def port(self) -> int:
        return int(self.wait_ready()["port"])

    def call(self, cmd: str, timeout_s: float = 20.0, **args: Any) -> dict[str, Any]:
        """Send one command and return its result; raises PeerError on error, death or timeout."""
        if self.proc.poll() is not None:
            raise PeerError(f"{self.name}: exited with {self.proc.returncode} before {cmd!r}")
        return self.reply(self.send(cmd, **args), cmd, timeout_s)

    def reply(self, ident: int, cmd: str = "command", timeout_s: float = 20.0) -> dict[str, Any]:
        """Wait for the reply to command `ident` (sent with `send`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise PeerError(f"{self.name}: no reply to {cmd!r} within {timeout_s} s") from None
            if reply is _EOF:
                self._replies.put(_EOF)
                raise PeerError(f"{self.name}: exited ({self.proc.poll()}) while running {cmd!r}; "
                                f"log: {self.log_tail()}")
            if reply.get("id") != ident:
                continue  # a reply to an earlier command that timed out
            if not reply.get("ok"):
                raise PeerError(f"{self.name}: {cmd!r} failed: {reply.get('error')}")
            result: dict[str, Any] = reply.get("result") or {}
            return result

    def send(self, cmd: str, **args: Any) -> int:
        """Send a command without waiting for its reply (used to race a kill against work)."""
        self._next_id += 1
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"id": self._next_id, "cmd": cmd, **args}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise PeerError(f"{self.name}: cannot send {cmd!r}: {exc}") from exc
        return self._next_id

    def wait_until(self, cond: Callable[[], bool], timeout_s: float, what: str = "condition") -> float:
        """Poll `cond` every 2 ms; return the seconds it took, or raise PeerError at the deadline."""
        start = time.monotonic()
        while not cond():
            if time.monotonic() - start > timeout_s:
                raise PeerError(f"{self.name}: {what} not reached within {timeout_s} s; "
                                f"log: {self.log_tail()}")
            if self.proc.poll() is not None and self.ready is None:
                raise PeerError(f"{self.name}: exited ({self.proc.returncode}) before ready; "
                                f"log: {self.log_tail()}")
            time.sleep(0.002)
        return time.monotonic() - start

    def settled(self, request_ids: Iterable[str]) -> bool:
        """Every request reported finished or failed on this (D) peer."""
        with self._lock:
            return all(r in self.finished_recving or r in self.failed_recving for r in request_ids)

    def sent(self, request_ids: Iterable[str]) -> bool:
        with self._lock:
            return all(r in self.finished_sending for r in request_ids)

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "<no log>"
        return self.log_path.read_text(errors="replace")[-chars:]

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask to exit, then terminate, then kill; always by this process's PID, always bounded."""
        if self.proc.poll() is None:
            with contextlib.suppress(PeerError, OSError, ValueError):
                self.signal(signal.SIGCONT)
                self.send("exit")
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=timeout_s)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()
        if not isinstance(self._log, int):
            self._log.close()


def call_all(peers: Sequence[PeerProcess], cmd: str, timeout_s: float = 60.0,
             **args: Any) -> list[dict[str, Any]]:
    """Send `cmd` to every peer first, then collect the replies (the peers work in parallel)."""
    idents = [peer.send(cmd, **args) for peer in peers]
    return [peer.reply(ident, cmd, timeout_s) for peer, ident in zip(peers, idents, strict=True)]


def stop_all(peers: Iterable[PeerProcess]) -> None:
    """Stop every peer; an error stopping one never leaves the others running."""
    peers = list(peers)
    for peer in peers:  # ask everyone first, so they shut down in parallel
        with contextlib.suppress(PeerError, OSError, ValueError):
            if peer.alive:
                peer.signal(signal.SIGCONT)
                peer.send("exit")
    errors: list[BaseException] = []
    for peer in peers:
        try:
            peer.stop()
        except BaseException as exc:  # keep going: every process must be reaped
            errors.append(exc)
    if errors:
        raise errors[0]


def python_argv(module_or_script: str, config: dict[str, Any]) -> list[str]:
    """argv for a peer: `python -m module CONFIG_JSON` or `python script.py CONFIG_JSON`."""
    if module_or_script.endswith(".py"):
        return [sys.executable, module_or_script, json.dumps(config)]
    return [sys.executable, "-m", module_or_script, json.dumps(config)]
