"""Await work for an HTTP request, cancelling it when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from kvlink.serve.errors import APIError

T = TypeVar("T")


async def _client_gone(raw: Request) -> None:
    """Returns when the ASGI server reports the client's disconnect (the body was read already)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (aborting the request) and answer 499.

    A task blocked on `receive()` sees the disconnect as soon as the server does, unlike
    polling `Request.is_disconnected()`, which can miss it on a busy event loop.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_gone(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError(499, "the client closed the connection", "client_closed")
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
