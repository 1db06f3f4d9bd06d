"""Listening sockets taken before a server loads anything, and uvicorn served on them.

A port already in use or an address that does not resolve is then a one-line refusal at
start, not a traceback after the model has loaded, and a server's "serving" line is printed
only once its sockets listen. Addresses are bound as asyncio (and so uvicorn) binds them:
every address the host resolves to (`localhost` may be 127.0.0.1 and ::1), all interfaces
for an empty host, IPv6 sockets IPv6-only.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterable
from typing import Any


class ListenError(OSError):
    """An address this process cannot listen on (the message names it and why)."""


def _where(host: str, port: int) -> str:
    return f"{host or '*'}:{port}" if port else (host or "*")


def _addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, tuple[Any, ...]]]:
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise ListenError(f"cannot listen on {_where(host, port)}: the address does not resolve ({exc})") from None
    return list(dict.fromkeys((family, address) for family, _, _, _, address in infos))


def listen(host: str, port: int, backlog: int = 2048) -> list[socket.socket]:
    """Sockets bound to every address of host:port and listening; ListenError (none left
    open) when one cannot be."""
    sockets: list[socket.socket] = []
    try:
        for family, address in _addresses(host, port):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.set_inheritable(False)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        if isinstance(exc, ListenError):
            raise
        raise ListenError(f"cannot listen on {_where(host, port)}: {exc.strerror or exc}") from None
    return sockets


def check_free(host: str, ports: Iterable[int]) -> None:
    """Raise ListenError unless every port can be listened on at host now (bound and let go at
    once; 0, an ephemeral port, only needs the host to resolve)."""
    for port in ports:
        if port:
            for sock in listen(host, port, backlog=1):
                sock.close()
        else:
            _addresses(host, port)


def check_kv_ports(host: str, ports: Iterable[int]) -> None:
    """As `check_free`, for the KV side channel, which binds as `socket.create_server` does
    (IPv4, the first address of host)."""
    for port in ports:
        try:
            socket.create_server((host, port)).close()
        except (OSError, UnicodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise ListenError(f"cannot listen on {_where(host, port)} (--kv-host, --kv-port): {reason}") from None


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def serve(app: Any, sockets: list[socket.socket], **options: Any) -> None:
    """Run uvicorn on sockets already listening (options as uvicorn.Config's) until it is
    stopped; Ctrl-C ends it quietly, and a server that never started exits 3, as uvicorn.run."""
    import uvicorn

    host, port = sockets[0].getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **options))
    # uvicorn stops gracefully on SIGTERM, then raises it again under the handler it found:
    # the default one would end the process before the caller's own shutdown (the engine, the
    # KV connector, the other TP ranks) runs, so SIGTERM ends here as Ctrl-C does.
    main_thread = threading.current_thread() is threading.main_thread()  # signals are set there only
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=sockets)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    if not server.started:
        raise SystemExit(3)
