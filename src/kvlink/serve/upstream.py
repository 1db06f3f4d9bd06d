"""The proxy's view of its P and D instances: least-loaded choice and errors that name the side.

Every failure of an upstream call becomes an `APIError` whose message says which
side (prefill or decode), which instance, and what went wrong, so a client never
has to guess and never waits without a deadline.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvlink.serve.errors import APIError


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

    def render(self, prefix: str) -> str:
        name = f"{prefix}_upstream_in_flight"
        lines = [f"# TYPE {name} gauge"]
        lines += [f'{name}{{side="{self.side}",url="{i.url}"}} {i.in_flight}' for i in self.instances]
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


def _error_code(response: httpx.Response) -> str | None:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return str(error.get("code")) if isinstance(error, dict) else None


def status_error(side: str, url: str, response: httpx.Response) -> APIError:
    """4xx keeps its status (the client's request is at fault); 5xx becomes 502."""
    message = upstream_message(response)
    if side == "decode" and _error_code(response) == "invalid_kv_transfer_params":
        # The proxy got these params from P, so they are not the client's fault: most often P
        # died or restarted after answering. A 4xx would tell the client not to retry.
        return APIError(
            502, f"decode instance {url} could not load the KV cache the prefill instance "
                 f"prepared (is the prefill instance still up?): {message}",
            "decode_kv_load_failed",
        )
    if response.status_code < 500:
        return APIError(
            response.status_code,
            f"{side} instance {url} refused the request (HTTP {response.status_code}): {message}",
            f"{side}_refused",
        )
    return APIError(
        502, f"{side} instance {url} failed (HTTP {response.status_code}): {message}",
        f"{side}_failed",
    )


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
