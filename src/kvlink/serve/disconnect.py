"""Await work for an HTTP request, cancelling it when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from kvlink.serve.errors import APIError

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (aborting the request) and answer 499."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "the client closed the connection", "client_closed")
    except asyncio.CancelledError:
        task.cancel()
        raise
