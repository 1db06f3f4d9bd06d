"""The request id a client may give (`X-Request-Id`): the proxy and every instance take the same.

An instance's id names the request in its logs, its `kv_transfer_params` and the NIXL
notifications D sends P about it (one of which carries every id D waits on from that P), so
it is bounded here rather than where a notification would outgrow its limit.
"""

from __future__ import annotations

import uuid

from fastapi import Request

from kvlink.serve.errors import APIError

MAX_REQUEST_ID_CHARS = 256


def request_id_of(raw: Request) -> str:
    """The client's x-request-id (printable ASCII, as HTTP headers carry it), or a new one."""
    given = raw.headers.get("x-request-id")
    if given is None or given == "":
        return uuid.uuid4().hex
    if not (given.isascii() and given.isprintable()) or len(given) > MAX_REQUEST_ID_CHARS:
        raise APIError(400, f"x-request-id must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters",
                       "invalid_value", param="x-request-id")
    return given
