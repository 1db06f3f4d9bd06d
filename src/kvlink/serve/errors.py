"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, and their handlers.

The status says what a client or router may do (docs/serving.md, "Errors"): 4xx means the
request itself is at fault and sending it again fails again; 502, 503 and 504 mean an
instance or the KV move failed and the request may be retried, after `Retry-After` seconds
when the answer carries that header.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",  # as OpenAI answers an unknown model or URL
    408: "timeout_error",
    422: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error to send to the client as it is: HTTP status plus a message saying what to do.

    `param`: the request field at fault; `retry_after_s`: sent as `Retry-After` (503s);
    `upstream_status`: the status an upstream instance answered, when the error is its answer."""

    def __init__(self, status: int, message: str, code: str | None = None, *,
                 param: str | None = None, retry_after_s: int | None = None,
                 upstream_status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.upstream_status = upstream_status

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)

    def response(self) -> JSONResponse:
        headers = {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    return APIError(status, message, code).response()


def _describe_validation(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(piece) for piece in item.get("loc", ()) if piece != "body")
        message = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app as an OpenAI-style body, including FastAPI's own 404/422."""

    async def on_api_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, APIError)
        return error.response()

    async def on_validation(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        return error_response(400, _describe_validation(error), "invalid_value")

    async def on_http(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        carried = getattr(error, "api_error", None)
        if isinstance(carried, APIError):
            return carried.response()
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, f"http_{error.status_code}")
        answer = error_response(error.status_code, f"{error.detail}: {request.method} {request.url.path}", code)
        for name, value in (error.headers or {}).items():  # e.g. a 405's Allow
            answer.headers[name] = value
        return answer

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
