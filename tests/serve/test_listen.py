"""Servers refuse an address they cannot listen on at once, in one line (exit 2), before
loading anything, and say they serve only once their socket listens."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvlink.procs.launcher import free_port
from kvlink.serve.listen import ListenError, check_free, check_kv_ports, listen

KVLINK = [sys.executable, "-m", "kvlink.cli.main"]


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _output_until(proc: subprocess.Popen[str], needle: str | None, timeout_s: float) -> str:
    """What `proc` wrote to its stdout pipe until `needle` appeared (None: until the pipe
    closed), the pipe closed, or `timeout_s` passed (each read waits at most for what is left)."""
    assert proc.stdout is not None
    fd, seen, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout_s
    while (needle is None or needle.encode() not in seen) and (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        seen += chunk
    return seen.decode(errors="replace")


def _run(argv: list[str], limit_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "KVLINK_SECRET": "ab" * 32}
    return subprocess.run([*KVLINK, *argv], env=env, capture_output=True, text=True, timeout=limit_s)


def test_listen_and_check_free(taken: int) -> None:
    [sock] = listen("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # it listens
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            check_free("127.0.0.1", [port])
    finally:
        sock.close()
    check_free("127.0.0.1", [0, free_port()])
    with pytest.raises(ListenError, match="does not resolve"):
        check_free("no-such-host.invalid", [0])
    with pytest.raises(ListenError, match=f"127.0.0.1:{taken}"):
        listen("127.0.0.1", taken)
    with pytest.raises(ListenError, match=f"127.0.0.1:{taken} \\(--kv-host, --kv-port\\)"):
        check_kv_ports("127.0.0.1", [taken])


def test_listen_binds_every_address_of_the_host_as_asyncio_does() -> None:
    """`localhost` may resolve to 127.0.0.1 and ::1: a server listens on each, as uvicorn's own
    bind did; an empty host is every interface."""
    port = free_port()
    want = {address[:2] for _, _, _, _, address in
            socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}
    sockets = listen("localhost", port)
    try:
        assert {s.getsockname()[:2] for s in sockets} == want
        for s in sockets:
            if s.family == socket.AF_INET6:
                assert s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
    finally:
        for s in sockets:
            s.close()
    everywhere = listen("", free_port())
    try:
        assert "0.0.0.0" in {s.getsockname()[0] for s in everywhere}
    finally:
        for s in everywhere:
            s.close()


@pytest.mark.parametrize("args", [
    ["--port", "{taken}"],
    ["--port", "{free}", "--kv-port", "{taken}"],
    ["--port", "{free}", "--kv-host", "no-such-host.invalid"],
    ["--host", "no-such-host.invalid", "--port", "{free}"],
])
def test_serve_refuses_an_address_before_loading_the_model(taken: int, args: list[str]) -> None:
    argv = [a.format(taken=taken, free=free_port()) for a in args]
    start = time.monotonic()
    proc = _run(["serve", "--role", "prefill", "--num-blocks", "8", *argv])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "kvlink serve: cannot listen on" in proc.stderr and "Traceback" not in proc.stderr
    assert "serving" not in proc.stdout and "loading" not in proc.stdout.lower()
    assert time.monotonic() - start < 20


def test_proxy_refuses_a_taken_port_and_serves_once_it_listens(taken: int) -> None:
    proc = _run(["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                 "--port", str(taken)])
    assert proc.returncode == 2 and f"kvlink proxy: cannot listen on 127.0.0.1:{taken}" in proc.stderr
    assert "Traceback" not in proc.stderr and "kvlink proxy on" not in proc.stdout
    port = free_port()
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    live = subprocess.Popen([*KVLINK, "proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = _output_until(live, "kvlink proxy on", 30)
        assert f"kvlink proxy on http://127.0.0.1:{port}" in line
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # listening by the time it said so
        live.send_signal(signal.SIGINT)  # Ctrl-C: a quiet exit 0, as before
        assert live.wait(timeout=15) == 0
        rest = _output_until(live, None, 10)
        assert "Traceback" not in rest, rest
    finally:
        live.terminate()
        try:
            live.wait(timeout=10)
        except subprocess.TimeoutExpired:
            live.kill()
            live.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_tp_instance_stops_cleanly_on_ctrl_c_and_sigterm_to_its_group(sig: signal.Signals) -> None:
    """A terminal's Ctrl-C (and a supervisor's SIGTERM) reaches every process of the group: the
    follower rank must not die of it before rank 0's orderly stop, which talks to it (that gave
    three tracebacks and exit 1); rank 0 stops its engine, connector and followers, exit 0."""
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "KVLINK_SECRET": "ab" * 32}
    # rank r's side channel listens on kv_port + r: both must be free (a taken kv_port + 1
    # killed the follower at startup once, in a full suite run)
    port, kv_port = free_port(), free_port(span=2)
    live = subprocess.Popen([*KVLINK, "serve", "--role", "decode", "--model", "tiny-hybrid", "--tp", "2",
                             "--port", str(port), "--kv-port", str(kv_port), "--num-blocks", "32", "--threads", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        seen = _output_until(live, "instance serving", 120)
        assert "instance serving" in seen, seen[-3000:]
        followers = subprocess.run(["pgrep", "-g", str(live.pid), "-f", "kvlink.engine.tp_worker"],
                                   capture_output=True, text=True).stdout.split()
        assert len(followers) == 1, followers
        os.killpg(live.pid, sig)
        assert live.wait(timeout=30) == 0
        rest = _output_until(live, None, 10)
        assert "Traceback" not in seen + rest, (seen + rest)[-3000:]
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{followers[0]}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{followers[0]}"), "the follower rank outlived rank 0"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(live.pid, signal.SIGKILL)
        live.wait(timeout=10)
