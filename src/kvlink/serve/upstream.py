"""The proxy's view of its P and D instances: least-loaded choice and errors that name the side.

Every failure of an upstream call becomes an `APIError` whose message says which
side (prefill or decode), which instance, and what went wrong, so a client never
has to guess and never waits without a deadline.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvlink.connector.stats import prom_label
from kvlink.serve.errors import APIError

# A client may reuse an idle connection only while the server surely keeps it open, so the
# proxy drops idle upstream connections (KEEPALIVE_EXPIRY_S) well before any server closes
# them: uvicorn's and vLLM's default is 5 s; kvlink's own servers keep them SERVER_KEEPALIVE_S.
KEEPALIVE_EXPIRY_S = 2.0
SERVER_KEEPALIVE_S = 15


@dataclass
class Instance:
    url: str
    in_flight: int = 0
    served: int = 0


@dataclass
class InstancePool:
    """Instances of one side; `acquire()` picks the one with the fewest requests in flight."""

    side: str
    instances: list[Instance]
    _turn: Iterator[int] = field(default_factory=lambda: itertools.count())

    @classmethod
    def of(cls, side: str, urls: list[str]) -> InstancePool:
        if not urls:
            raise ValueError(f"the proxy needs at least one {side} instance URL")
        return cls(side, [Instance(url.rstrip("/")) for url in urls])

    def take(self) -> Instance:
        """The least-loaded instance, counted as busy until `release`."""
        # Ties rotate, so equally idle instances share the load instead of the first taking all.
        start = next(self._turn) % len(self.instances)
        rotated = self.instances[start:] + self.instances[:start]
        chosen = min(rotated, key=lambda instance: instance.in_flight)
        chosen.in_flight += 1
        return chosen

    def release(self, instance: Instance) -> None:
        instance.in_flight -= 1
        instance.served += 1

    @contextmanager
    def acquire(self) -> Iterator[Instance]:
        instance = self.take()
        try:
            yield instance
        finally:
            self.release(instance)

    def describe(self) -> list[dict[str, Any]]:
        return [vars(instance).copy() for instance in self.instances]

    def samples(self, name: str) -> list[str]:
        return [f'{name}{{side="{prom_label(self.side)}",url="{prom_label(i.url)}"}} {i.in_flight}'
                for i in self.instances]


def render_pools(prefix: str, pools: Sequence[InstancePool]) -> str:
    """Requests in flight per upstream, every pool under one metric (one TYPE line)."""
    name = f"{prefix}_upstream_in_flight"
    lines = [f"# TYPE {name} gauge"] + [line for pool in pools for line in pool.samples(name)]
    return "\n".join(lines) + "\n"


def upstream_message(response: httpx.Response) -> str:
    """The error message an upstream put in its body, or the start of the body."""
    try:
        body = response.json()
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(body, dict) and body.get("detail"):
            return str(body["detail"])
    except ValueError:
        pass
    return response.text[:300] or "(empty body)"


_CODE = re.compile(r"[a-z0-9_]{1,64}")  # codes are ours; anything else is not passed on (metric labels)
_DEFAULT_RETRY_AFTER_S = 1
# D refuses P's params: the proxy got them from P, so they are not the client's fault (P died,
# restarted, or its lease ran out before D read). A 4xx would tell the client not to retry.
_PARAMS_FROM_P = {"invalid_kv_transfer_params", "forbidden_kv_transfer_params"}


def _error_field(response: httpx.Response, name: str) -> str | None:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    value = error.get(name) if isinstance(error, dict) else None
    return value if isinstance(value, str) and _CODE.fullmatch(value) else None


def _retry_after(response: httpx.Response) -> int:
    value = response.headers.get("retry-after", "")
    # Seconds only (not an HTTP date); isdigit() alone also takes digits like "²" int() refuses.
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 6 else _DEFAULT_RETRY_AFTER_S


def status_error(side: str, url: str, response: httpx.Response) -> APIError:
    """What the proxy answers for an upstream's error status (kept in `upstream_status`).

    4xx keeps its status and code (the client's request is at fault); 503 and 504 keep
    theirs (an instance busy or dead, a deadline), with the upstream's Retry-After; 502
    keeps its code (e.g. D's `kv_load_failed`); any other 5xx becomes 502."""
    error = _status_error(side, url, response)
    error.upstream_status = response.status_code
    return error


def _status_error(side: str, url: str, response: httpx.Response) -> APIError:
    status, message = response.status_code, upstream_message(response)
    code, param = _error_field(response, "code"), _error_field(response, "param")
    if side == "decode" and code in _PARAMS_FROM_P:
        return APIError(
            502, f"decode instance {url} could not load the KV cache the prefill instance "
                 f"prepared (is the prefill instance still up?): {message}",
            "decode_kv_load_failed",
        )
    if status < 500 and param == "kv_transfer_params":
        # The proxy wrote these params (the client's never pass): the upstream is not what
        # its side needs, a configuration fault, not the client's.
        return APIError(
            502, f"{side} instance {url} refused the kv_transfer_params the proxy sent it (HTTP "
                 f"{status}): {message}. The client sent none: this is a fault between the proxy, P "
                 f"and D (e.g. an upstream not running with --role {side}, or P and D set up "
                 f"differently)", f"{side}_failed",
        )
    if status < 500:
        return APIError(
            status, f"{side} instance {url} refused the request (HTTP {status}): {message}",
            code or f"{side}_refused", param=param,
        )
    described = f"{side} instance {url} failed (HTTP {status}): {message}"
    if status == 503:
        return APIError(503, described, code or f"{side}_unavailable",
                        retry_after_s=_retry_after(response))
    if status == 504:
        return APIError(504, described, code or f"{side}_timeout")
    if status == 502:
        return APIError(502, described, code or f"{side}_failed")
    return APIError(502, described, f"{side}_failed")


def transport_error(side: str, url: str, error: Exception, timeout_s: float) -> APIError:
    if isinstance(error, (httpx.TimeoutException, TimeoutError)):
        return APIError(
            504, f"{side} instance {url} did not answer within {timeout_s:g}s", f"{side}_timeout"
        )
    if isinstance(error, httpx.ConnectError):
        return APIError(
            502, f"{side} instance {url} is unreachable ({error}); is it running?",
            f"{side}_unreachable",
        )
    return APIError(502, f"{side} instance {url} broke the connection: {error!r}", f"{side}_failed")
