"""Helpers for fault cases against a real P/D cluster: timed requests, metrics, fault windows."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvlink.bench.cluster import Cluster, ClusterSpec
from kvlink.bench.instance_state import metric

__all__ = ["metric"]


@dataclass
class Result:
    status: int | None  # None: transport error (connection reset, timeout)
    text: str | None
    error: str | None
    elapsed_s: float


def complete(url: str, prompt: str, max_tokens: int, timeout_s: float) -> Result:
    """One non-streaming completion; never waits past `timeout_s`."""
    started = time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    try:
        response = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
    except httpx.HTTPError as error:
        return Result(None, None, repr(error), time.monotonic() - started)
    elapsed = time.monotonic() - started
    answer = response.json()
    if response.status_code == 200:
        return Result(200, answer["choices"][0]["text"], None, elapsed)
    return Result(response.status_code, None, answer.get("error", {}).get("message"), elapsed)


def prompt_of(i: int) -> str:
    """Mixed prompt lengths (about 10 to 300 tokens), distinct per i."""
    words = ["alpha", "river", "stone", "quiet", "seven", "lamp", "north", "glass"]
    n = 5 + (i * 37) % 150
    return f"request {i}: " + " ".join(words[(i + k) % len(words)] for k in range(n))


class Expected:
    """Texts of the colocated reference instance, computed once per (prompt, max_tokens)."""

    def __init__(self, reference_url: str) -> None:
        self.url = reference_url
        self._cache: dict[tuple[str, int], str] = {}

    def __call__(self, prompt: str, max_tokens: int) -> str:
        key = (prompt, max_tokens)
        if key not in self._cache:
            result = complete(self.url, prompt, max_tokens, 30)
            assert result.status == 200 and result.text is not None, result
            self._cache[key] = result.text
        return self._cache[key]


def run_stream(url: str, indices: range, expected: Expected, max_tokens: int = 8,
               timeout_s: float = 20.0) -> list[Result]:
    """Requests one after another; each must be 200 with the reference text."""
    results = []
    for i in indices:
        result = complete(url, prompt_of(i), max_tokens, timeout_s)
        assert result.status == 200, f"request {i}: {result}"
        assert result.text == expected(prompt_of(i), max_tokens), f"request {i}: wrong text"
        results.append(result)
    return results


def in_background(fn: Callable[[], Result]) -> Callable[[float], Result]:
    """Run `fn` in a thread; the returned function joins it with a deadline."""
    box: list[Result] = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()

    def join(timeout_s: float) -> Result:
        thread.join(timeout_s)
        assert box, f"client still waiting after {timeout_s}s"
        return box[0]

    return join


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what} not seen within {timeout_s}s")
        time.sleep(0.05)
    return time.monotonic() - started


def fault_spec(**overrides: Any) -> ClusterSpec:
    """The fault cases' deployment: tiny-hybrid 1P1D, a colocated reference, D recomputing
    failed loads, 60 s request deadlines; `overrides` on top."""
    return ClusterSpec(**{"model": "tiny-hybrid", "num_blocks": 64, "colocated": True,
                          "load_failure_policy": "recompute", "request_timeout_s": 60.0, **overrides})


def running_cluster(config: ClusterSpec, name: str, timeout_s: float = 180.0) -> Iterator[Cluster]:
    """Start the cluster (logs in the temp dir, outside pytest's rotating basetemp, so they
    survive for a post-mortem), yield it, and stop every process whatever happened, first
    resuming any that a case left stopped."""
    c = Cluster(config, Path(tempfile.gettempdir()) / f"{name}-{os.getpid()}")
    c.start(timeout_s=timeout_s)
    try:
        yield c
    finally:
        resume_all(c)
        c.stop()


def url_of(cluster: Cluster, which: str) -> str:
    return cluster.service(which).url


def connector(cluster: Cluster, which: str) -> dict[str, Any]:
    state: dict[str, Any] = cluster.state(which)["engine"]["connector"]
    return state


def request_parked_at_decode(cluster: Cluster, request: Callable[[], Result]) -> Callable[[float], Result]:
    """Start `request` through the proxy with D frozen, so P finishes the prefill and holds the
    blocks while D has not started reading. Returns the join function; D is still stopped.

    "Parked" means all three: P holds a lease, the proxy has the decode leg under way, and
    bytes wait unread in a socket of D's HTTP port."""
    stop(cluster, "decode")
    proxy = url_of(cluster, "proxy")
    join: Callable[[float], Result] | None = None
    try:
        join = in_background(request)
        wait_for(lambda: connector(cluster, "prefill")["leases"] >= 1, 20, "P holding the request")
        wait_for(lambda: metric(proxy, "upstream_in_flight", 'side="decode"') >= 1, 20,
                 "the proxy sending the decode leg")
        wait_for(lambda: unread_bytes(cluster.member("decode").port) > 0, 20, "the request waiting in D's socket")
    except BaseException as error:
        cluster.signal("decode", signal.SIGCONT)
        raise AssertionError(f"{error}; {_client_said(join)}; proxy log:\n"
                             f"{cluster.service('proxy').log_tail(6)}") from None
    return join


def _client_said(join: Callable[[float], Result] | None) -> str:
    if join is None:
        return "request not started"
    try:
        return f"client got {join(0.0)}"
    except AssertionError:
        return "client still waiting"


def unread_bytes(port: int) -> int:
    """Bytes received by the kernel but not yet read, on established TCP sockets of local `port`."""
    out = subprocess.run(["ss", "-tnH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, timeout=5, check=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if line.strip())


def thread_states(pid: int) -> str:
    """The scheduler state letter of each thread of `pid` ("T": stopped), e.g. "TTT"."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue
    return "".join(sorted(states))


def stop(cluster: Cluster, which: str) -> None:
    """SIGSTOP an engine and wait (bounded) until every thread of it is stopped."""
    cluster.signal(which, signal.SIGSTOP)
    pid = cluster.service(which).proc.pid
    wait_for(lambda: set(thread_states(pid)) <= {"T", "t", "Z"}, 5, f"{which} stopped ({thread_states(pid)})")


def read_posted_against_frozen_p(cluster: Cluster, request: Callable[[], Result],
                                 attempts: int = 2) -> Callable[[float], Result]:
    """D's READ is posted and in flight while P is frozen (UCX over TCP: it stays PROC).

    Returns the join function; P is left stopped, D running. If the READ was not caught in
    flight but the request was answered all the same, the window was missed (not what the
    case is about): that is reported on stdout and the setup runs once more."""
    for attempt in range(attempts):
        join = request_parked_at_decode(cluster, request)
        stop(cluster, "prefill")
        cluster.signal("decode", signal.SIGCONT)
        try:
            wait_for(lambda: connector(cluster, "decode")["open_transfers"] >= 1, 10, "D's READ in flight")
            return join
        except AssertionError as error:
            p_states = thread_states(cluster.service("prefill").proc.pid)
            cluster.signal("prefill", signal.SIGCONT)  # the next cases need a live P
            said = _client_said(join)
            report = (f"{error}; P threads {p_states!r}; D state {cluster.state('decode')}; {said}; "
                      f"D log:\n{cluster.service('decode').log_tail(8)}\nproxy log:\n"
                      f"{cluster.service('proxy').log_tail(6)}")
            if attempt + 1 < attempts and said.startswith("client got Result(status=200"):
                print(f"[setup] READ not caught in flight, trying again: {report}")
                wait_clean_after_miss(cluster)
                continue
            raise AssertionError(report) from None
    raise AssertionError("unreachable")


def wait_clean_after_miss(cluster: Cluster) -> None:
    """After a missed window both engines are running; let P free what D read."""
    wait_for(lambda: connector(cluster, "prefill")["leases"] == 0, 10, "P's leases freed")


def resume_all(cluster: Cluster) -> None:
    """SIGCONT every live engine: a case that failed half-way may have left one stopped."""
    for which in ("prefill", "decode"):
        svc = getattr(cluster, which)
        if svc is not None and svc.proc.poll() is None:
            cluster.signal(which, signal.SIGCONT)
