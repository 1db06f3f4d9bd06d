"""Listening sockets taken before a server loads anything, and uvicorn served on them.

A port already in use or an address that does not resolve is then a one-line refusal at
start, not a traceback after the model has loaded, and a server's "serving" line is printed
only once its socket listens.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any


class ListenError(OSError):
    """An address this process cannot listen on (the message names it and why)."""


def _family(host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        where = f"{host}:{port}" if port else host
        raise ListenError(f"cannot listen on {where}: the address does not resolve ({exc})") from None
    family, _, _, _, address = infos[0]
    return family, address


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket bound to host:port and listening; ListenError when it cannot be."""
    family, address = _family(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock


def check_free(host: str, ports: Iterable[int]) -> None:
    """Raise ListenError unless every port can be bound on host now (bound and let go at once;
    0, an ephemeral port, always can)."""
    for port in ports:
        if port:
            listen(host, port, backlog=1).close()
        else:
            _family(host, port)


def serve(app: Any, sock: socket.socket, **options: Any) -> None:
    """Run uvicorn on an already listening socket (options as uvicorn.Config's)."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **options))
    server.run(sockets=[sock])
