"""A cap on request bodies, for the instances and the proxy.

Nothing a client may send needs more than a few hundred KiB (a prompt fills at most the
context), while a body of tens of MiB costs seconds of parsing and tokenizing on the event
loop and GiBs of memory. Bodies over `MAX_BODY_BYTES` get 413 before they are read whole:
at once when `Content-Length` says so, else when the stream passes the cap.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException

from kvlink.serve.errors import APIError

MAX_BODY_BYTES = 8 * 2**20
Scope = dict[str, Any]


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body over {limit // 2**20} MiB; a request this large cannot fit any "
                         "context this instance serves", "request_too_large")


class BodyTooLarge(HTTPException):
    """Raised while the body is read: an HTTPException, which FastAPI's body parsing passes
    on as it is (any other error there becomes a 400); answered as `api_error`."""

    def __init__(self, limit: int) -> None:
        self.api_error = _too_large(limit)
        super().__init__(413, self.api_error.message)


class BodyLimit:
    """ASGI middleware: 413 for an HTTP request body over `limit` bytes."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            await _too_large(self.limit).response()(scope, receive, send)
            return
        received = 0

        async def limited() -> dict[str, Any]:
            nonlocal received
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)


def limit_bodies(app: FastAPI, limit: int = MAX_BODY_BYTES) -> None:
    app.add_middleware(BodyLimit, limit=limit)
