"""The P/D proxy: prefill on a P instance (one token), then decode on a D instance with P's params.

For each request: P gets `max_tokens=1`, `stream=false` and
`kv_transfer_params={"do_remote_decode": true}`; the `kv_transfer_params` of P's
answer go, with the client's original body, to D; D's answer goes back to the
client (SSE passed through unchanged). Instances are chosen least-loaded.

The time spent at P goes back to the client as `x-kvlink-prefill-s` (every answer)
and as `prefill_s` in D's `kvlink` figures object (JSON answers), so a client sees
the whole split of its time to first token: P prefill, KV move, D's first token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Annotated, Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kvlink.serve.body_limit import limit_bodies
from kvlink.serve.disconnect import unless_disconnected
from kvlink.serve.errors import APIError, install_error_handlers
from kvlink.serve.metrics import MetricsRegistry
from kvlink.serve.request_ids import request_id_of
from kvlink.serve.upstream import (
    KEEPALIVE_EXPIRY_S,
    Instance,
    InstancePool,
    render_pools,
    status_error,
    transport_error,
)

PREFILL_HEADER = "x-kvlink-prefill-s"
HAND_BACK_TIMEOUT_S = 5.0  # the proxy's call giving P back the params of a failed decode leg
LAYERWISE_P_GRACE_S = 0.25  # a failed layerwise request: how long P's answer may still come

logger = logging.getLogger("kvlink.proxy")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    """A client's body as strict JSON: NaN, Infinity and numbers that overflow a float are
    refused here (400), since they could not be forwarded to P and D as JSON; so is nesting
    too deep for the parser."""
    try:
        return json.loads(raw, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("it is nested too deeply") from None


def encode_body(body: dict[str, Any]) -> bytes:
    """A body as JSON bytes for an instance: ASCII-escaped, so text no UTF-8 can carry (a
    lone surrogate) still goes as JSON, for the instance to judge."""
    return json.dumps(body).encode("ascii")


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# The fields P's leg rewrites: a bad value here would reach only D, after P had prefilled for
# nothing, so the proxy checks them first, with the lax types the instances use (pydantic),
# and passes them on as those read them (`"5"` as 5, `"false"` as false; null `stream` as
# false, null in `stream_options` left out), so that what P accepts D accepts too.
_REWRITTEN: dict[str, TypeAdapter[Any]] = {
    "max_tokens": TypeAdapter(Annotated[int, Field(ge=1)] | None),
    "max_completion_tokens": TypeAdapter(Annotated[int, Field(ge=1)] | None),
    "min_tokens": TypeAdapter(Annotated[int, Field(ge=0)] | None),
    "stream": TypeAdapter(bool | None),
    "stream_options": TypeAdapter(_StreamOptions | None),
}


def check_rewritten(body: dict[str, Any]) -> None:
    """400 for a value of a field P's leg rewrites that no instance would take; the others
    are written back as an instance reads them."""
    asked = body.get("kv_transfer_params")
    if asked is not None:
        # The proxy reads only the mode a client picks; it writes P's and D's params itself.
        if not isinstance(asked, dict):
            raise APIError(400, f"kv_transfer_params must be an object, got {type(asked).__name__}",
                           "invalid_value", param="kv_transfer_params")
        if asked.get("transfer_mode") not in (None, "pull", "push", "layerwise"):
            raise APIError(400, f"kv_transfer_params.transfer_mode must be one of pull, push, layerwise, got "
                                f"{asked.get('transfer_mode')!r}"[:300], "invalid_value", param="kv_transfer_params")
    for name, adapter in _REWRITTEN.items():
        if name not in body:
            continue
        try:
            value = adapter.validate_python(body[name])
        except ValidationError as error:
            problem = error.errors()[0].get("msg", "invalid value")
            raise APIError(400, f"{name}={body[name]!r}: {problem}", "invalid_value", param=name) from None
        if isinstance(value, _StreamOptions):
            value = {k: v for k, v in value.model_dump().items() if v is not None}
        elif name == "stream" and value is None:
            value = False
        body[name] = value


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """P computes the prompt's KV and one token; it keeps the blocks for D to read."""
    request = dict(body)
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    request["stream"] = False
    request.pop("stream_options", None)
    minimum = request.get("min_tokens")
    if isinstance(minimum, int) and not isinstance(minimum, bool) and minimum > 1:
        request["min_tokens"] = 1  # D's answer needs them, P's one token cannot (a bad value: P says so)
    asked = body.get("kv_transfer_params")
    mode = asked.get("transfer_mode") if isinstance(asked, dict) else None
    request["kv_transfer_params"] = {"do_remote_decode": True}
    if mode in ("pull", "push"):  # the client picks the classic mode per request; else P's default
        request["kv_transfer_params"]["transfer_mode"] = mode
    return request




def layerwise_prefill_body(body: dict[str, Any], key: str) -> dict[str, Any]:
    """P prefills and writes into the blocks of whichever D asks for `key` (D's
    `remote_request_id`: P's own id may differ, vLLM renames its requests)."""
    request = prefill_body(body)
    request["kv_transfer_params"] = {"do_remote_decode": True, "transfer_mode": "layerwise", "layerwise_id": key}
    return request


def wants_layerwise(body: dict[str, Any], mode: str) -> bool:
    params = body.get("kv_transfer_params")
    asked = params.get("transfer_mode") if isinstance(params, dict) else None
    return asked == "layerwise" or (mode == "layerwise" and asked is None)


def build_proxy_app(
    prefill_urls: list[str], decode_urls: list[str], *, timeout_s: float = 120.0,
    connect_timeout_s: float = 5.0, mode: str = "classic",
) -> FastAPI:
    """`mode` "classic": P, then D with P's params; "layerwise": both at once (see
    `route_layerwise`). A request's `kv_transfer_params.transfer_mode` picks per request."""
    if mode not in ("classic", "layerwise"):
        raise ValueError(f"proxy mode must be 'classic' or 'layerwise', got {mode!r}")
    prefill = InstancePool.of("prefill", prefill_urls)
    decode = InstancePool.of("decode", decode_urls)
    metrics = MetricsRegistry("kvlink_proxy")
    metrics.fragments.append(lambda: render_pools("kvlink_proxy", (prefill, decode)))
    timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
    # Reusing an idle connection the server is closing at that very moment loses the request
    # ("server disconnected without sending a response"): see KEEPALIVE_EXPIRY_S.
    limits = httpx.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    client = httpx.AsyncClient(timeout=timeout, limits=limits)
    app = FastAPI(title="kvlink P/D proxy", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    limit_bodies(app)

    async def post_json(side: str, instance: Instance, path: str, body: dict[str, Any],
                        headers: dict[str, str]) -> dict[str, Any]:
        try:
            # One deadline for the whole call: httpx's read timeout alone restarts per chunk.
            response = await asyncio.wait_for(
                client.post(instance.url + path, content=encode_body(body),
                            headers={**headers, "Content-Type": "application/json"}), timeout_s)
        except Exception as error:
            raise transport_error(side, instance.url, error, timeout_s) from error
        if response.status_code != 200:
            raise status_error(side, instance.url, response)
        try:
            answer: dict[str, Any] = response.json()
        except ValueError as error:
            raise APIError(502, f"{side} instance {instance.url} answered with non-JSON: "
                                f"{response.text[:200]!r}", f"{side}_failed") from error
        return answer

    def log_request(request_id: str, prefill_s: float | None, decode_url: str | None,
                    started: float, outcome: str) -> None:
        total_s = time.monotonic() - started
        metrics.observe("total_seconds", total_s)  # every request, any outcome
        prefill = "-" if prefill_s is None else f"{prefill_s * 1e3:.1f}ms"
        logger.info("request %s prefill=%s decode=%s total=%.1fms outcome=%s", request_id, prefill,
                    decode_url or "-", total_s * 1e3, outcome)

    async def run_prefill(path: str, body: dict[str, Any],
                          headers: dict[str, str]) -> tuple[dict[str, Any], float, str]:
        """P's `kv_transfer_params`, the seconds the prefill leg took and P's URL."""
        started = time.monotonic()
        with prefill.acquire() as instance:
            answer = await post_json("prefill", instance, path, prefill_body(body), headers)
        prefill_s = time.monotonic() - started
        metrics.observe("prefill_seconds", prefill_s)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise APIError(502, f"prefill instance {instance.url} answered without "
                                "kv_transfer_params; is it running with --role prefill?",
                           "prefill_failed")
        learn_endpoint(instance.url, params, started)
        return params, prefill_s, instance.url

    handing_back: set[asyncio.Task[None]] = set()

    def decode_is_done(error: APIError) -> bool:
        """Whether a failed decode leg leaves P's KV to nobody: D never got the params (it was
        unreachable) or answered an error (its load is over). Not after a timeout or a client
        that left: D may be reading P's blocks still, and its own abort tells P."""
        return error.code == "decode_unreachable" or error.upstream_status is not None

    async def stop_handing_back() -> None:
        for task in list(handing_back):
            task.cancel()
        await asyncio.gather(*handing_back, return_exceptions=True)
        await client.aclose()

    app.router.add_event_handler("shutdown", stop_handing_back)

    async def hand_back(p_url: str, params: dict[str, Any], headers: dict[str, str]) -> None:
        """Give P back the params of a request no decoder got, so it frees the blocks now
        (not when its lease ends). A P without the endpoint (vLLM) answers 404: its lease
        frees them."""
        try:
            response = await client.post(p_url + "/v1/kv_release", content=encode_body({"kv_transfer_params": params}),
                                         headers={**headers, "Content-Type": "application/json"},
                                         timeout=HAND_BACK_TIMEOUT_S)
            if response.status_code == 200:
                outcome = "released" if response.json().get("released") else "nothing_held"
            else:
                outcome = "unsupported" if response.status_code == 404 else f"http_{response.status_code}"
        except Exception as error:
            outcome = "failed"
            logger.warning("request %s: could not hand its KV params back to %s: %r", headers.get("X-Request-Id"),
                           p_url, error)
        metrics.inc("params_handed_back_total", outcome=outcome)
        logger.info("request %s: KV params handed back to %s unused: %s", headers.get("X-Request-Id"), p_url, outcome)

    def in_background(work: Coroutine[Any, Any, None]) -> None:
        """Run `work` after the answer went out; the proxy cancels what is left when it stops."""
        task = asyncio.get_running_loop().create_task(work)
        handing_back.add(task)
        task.add_done_callback(handing_back.discard)

    async def settle(p_call: asyncio.Future[dict[str, Any]], p_url: str, headers: dict[str, str]) -> None:
        """A layerwise request D is done with (D refused it, or was unreachable) while P's call
        runs or has just answered. P's answer may be on its way already: cancelling the call
        then would drop it, and P, its answer sent, would hold the blocks for a push nobody
        asks for until its lease ends. So P gets a moment to answer (its params are handed
        back) before its call is cancelled (the closed connection aborts P's request)."""
        try:
            await asyncio.wait({p_call}, timeout=LAYERWISE_P_GRACE_S)
        except asyncio.CancelledError:  # the proxy is stopping
            p_call.cancel()
            raise
        if not p_call.done():
            p_call.cancel()
        elif not p_call.cancelled() and p_call.exception() is None:
            params = p_call.result().get("kv_transfer_params")
            if isinstance(params, dict):
                await hand_back(p_url, params, headers)

    async def stream_decode(path: str, body: dict[str, Any], headers: dict[str, str],
                            started: float, prefill_s: float) -> Response:
        instance = decode.take()
        request_id = headers["X-Request-Id"]
        sent = time.monotonic()
        try:
            request = client.build_request("POST", instance.url + path, content=encode_body(body),
                                           headers={**headers, "Content-Type": "application/json"})
            response = await asyncio.wait_for(client.send(request, stream=True), timeout_s)
        except asyncio.CancelledError:  # the client left before D's first token
            decode.release(instance)
            raise
        except Exception as error:
            decode.release(instance)
            raise transport_error("decode", instance.url, error, timeout_s) from error
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            decode.release(instance)
            raise status_error("decode", instance.url, response)

        async def passthrough() -> AsyncIterator[bytes]:
            first = True
            # Counted once, by the code a client would see: the stream's end, the error event
            # it got, or (it left mid-stream) the 499 it would have had.
            code, outcome = "client_closed", "client_closed (the client left mid-stream)"
            try:
                async for chunk in response.aiter_raw():
                    if first:
                        metrics.observe("decode_ttft_seconds", time.monotonic() - sent)
                        first = False
                    yield chunk
                code = outcome = "ok"
            except httpx.HTTPError as error:
                api_error = transport_error("decode", instance.url, error, timeout_s)
                code = api_error.code or "error"
                outcome = f"{code} ({api_error.message})"
                event = json.dumps(api_error.body())  # headers are gone: the status is in the event
                yield f"data: {event}\n\ndata: [DONE]\n\n".encode()
            finally:
                metrics.inc("requests_total", outcome=code)
                # Shielded: on client disconnect this task is cancelled, and closing the
                # upstream stream is what makes D abort the request.
                with anyio.CancelScope(shield=True):
                    await response.aclose()
                decode.release(instance)
                log_request(request_id, prefill_s, instance.url, started, outcome)

        return StreamingResponse(passthrough(), media_type="text/event-stream",
                                 headers={PREFILL_HEADER: f"{prefill_s:.6f}"})

    # P's side channel per P instance (fixed for the life of P): from P's /v1/kv_endpoint, or,
    # for a P without one (vLLM), from the params of its first classic answer.
    endpoints: dict[str, dict[str, Any]] = {}
    no_endpoint: set[str] = set()
    endpoint_keys = ("remote_engine_id", "remote_host", "remote_port", "tp_size")

    # When a failed layerwise request made the proxy forget a P's endpoint: an answer to a call
    # made before then may name P as it was before a restart, and must not teach it again.
    forgotten_at: dict[str, float] = {}

    def asked_since_forgotten(url: str, asked_at: float) -> bool:
        return asked_at >= forgotten_at.get(url, float("-inf"))

    def learn_endpoint(url: str, params: dict[str, Any], asked_at: float) -> None:
        """P's params name its side channel as it is now (a restarted P has a new engine id)."""
        if asked_since_forgotten(url, asked_at) and all(key in params for key in endpoint_keys):
            endpoints[url] = {key: params[key] for key in endpoint_keys}

    def forget_endpoint(url: str) -> None:
        forgotten_at[url] = time.monotonic()
        endpoints.pop(url, None)

    async def kv_endpoint(instance: Instance) -> dict[str, Any] | None:
        known = endpoints.get(instance.url)
        if known is not None or instance.url in no_endpoint:
            return known
        asked_at = time.monotonic()
        try:
            response = await asyncio.wait_for(client.get(instance.url + "/v1/kv_endpoint"), timeout_s)
        except Exception as error:
            raise transport_error("prefill", instance.url, error, timeout_s) from error
        if response.status_code != 200:
            logger.info("prefill instance %s has no /v1/kv_endpoint (HTTP %d): its next request goes the "
                        "classic way, and its params tell where later layerwise requests go",
                        instance.url, response.status_code)
            if response.status_code == 404:  # not one of ours (vLLM); a P starting up is asked again
                no_endpoint.add(instance.url)
            return None
        endpoint = dict(response.json())
        if asked_since_forgotten(instance.url, asked_at):
            endpoints[instance.url] = endpoint
        return endpoint

    async def route_layerwise(raw: Request, path: str, body: dict[str, Any], headers: dict[str, str],
                              started: float) -> Response | None:
        """P and D at once: D allocates and asks P (by request id, for this prompt) to write
        each layer into its blocks as P computes it. A P failure before D answers cancels D.
        None: P's side channel is not known yet (the caller goes the classic way)."""
        request_id = headers["X-Request-Id"]
        p_instance = prefill.take()
        try:
            endpoint = await kv_endpoint(p_instance)
        except APIError:
            prefill.release(p_instance)
            raise
        if endpoint is None:
            prefill.release(p_instance)
            return None
        asked_at = time.monotonic()
        p_call = asyncio.ensure_future(post_json("prefill", p_instance, path, layerwise_prefill_body(body, request_id), headers))
        p_call.add_done_callback(lambda _: prefill.release(p_instance))

        def p_done(task: asyncio.Future[Any]) -> None:
            if task.cancelled():
                logger.info("request %s: layerwise prefill cancelled", request_id)
                return
            failure = task.exception()
            if failure is not None:
                logger.warning("request %s: layerwise prefill failed: %s", request_id, failure)
            else:
                params = task.result().get("kv_transfer_params")
                if isinstance(params, dict):
                    learn_endpoint(p_instance.url, params, asked_at)
                taken = time.monotonic() - started
                metrics.observe("prefill_seconds", taken)
                # P's leg of a layerwise request (its queue, prefill and answer), as the
                # classic legs' prefill time: what `kvlink bench layerwise` subtracts
                logger.info("request %s: layerwise prefill answered after %.1fms", request_id, taken * 1e3)

        p_call.add_done_callback(p_done)
        d_params = {"do_remote_prefill": True, "transfer_mode": "layerwise", "remote_request_id": request_id,
                    "remote_block_ids": [], **endpoint}
        decode_request = dict(body, kv_transfer_params=d_params)

        async def decode_leg() -> Response:
            if body.get("stream"):
                return await stream_decode(path, decode_request, headers, started, 0.0)
            sent = time.monotonic()
            with decode.acquire() as instance:
                answer = await post_json("decode", instance, path, decode_request, headers)
            metrics.observe("decode_seconds", time.monotonic() - sent)
            return JSONResponse(answer)

        d_call = asyncio.ensure_future(decode_leg())
        try:
            await asyncio.wait({p_call, d_call}, return_when=asyncio.FIRST_COMPLETED)
            if p_call.done() and not p_call.cancelled() and p_call.exception() is not None and not d_call.done():
                d_call.cancel()  # D would only wait for KV that will not come
                raise p_call.exception()  # type: ignore[misc]
            response = await d_call
        except BaseException as error:
            d_call.cancel()
            if isinstance(error, APIError) and decode_is_done(error):
                in_background(settle(p_call, p_instance.url, headers))
                # P may have restarted under another engine id (D then refuses the handshake):
                # the next layerwise request asks P again, or goes the classic way for a P
                # without /v1/kv_endpoint, whose answer names P as it is now.
                forget_endpoint(p_instance.url)
            else:  # D may be taking P's WRITEs: only its own cancel may end them
                p_call.cancel()
            raise
        if not body.get("stream"):
            metrics.inc("requests_total", outcome="ok")
            log_request(request_id, None, None, started, "ok (layerwise)")
        return response

    async def route(raw: Request, path: str) -> Response:
        started = time.monotonic()
        try:
            try:
                body = parse_json(await raw.body())
            except ValueError as error:
                raise APIError(400, f"request body is not valid JSON: {error}", "invalid_json") from error
            if not isinstance(body, dict):
                raise APIError(400, "request body must be a JSON object", "invalid_json")
            check_rewritten(body)
            request_id = request_id_of(raw)
        except APIError as error:  # refused before any instance was asked: counted and logged all the same
            metrics.inc("requests_total", outcome=error.code or "error")
            log_request("-", None, None, started, f"{error.code or 'error'} ({error.message})")
            raise
        headers = {"X-Request-Id": request_id}
        if "authorization" in raw.headers:
            headers["Authorization"] = raw.headers["authorization"]
        prefill_s: float | None = None
        decode_url: str | None = None
        if wants_layerwise(body, mode):
            try:
                layered = await unless_disconnected(raw, route_layerwise(raw, path, body, headers, started))
            except APIError as error:
                metrics.inc("requests_total", outcome=error.code or "error")
                log_request(request_id, None, None, started, f"{error.code or 'error'} ({error.message})")
                raise
            if layered is not None:
                return layered
        try:
            # A client that leaves while P prefills must not get its KV moved to D for nobody:
            # cancelling the upstream call closes that connection, and the instance aborts.
            params, prefilled_s, p_url = await unless_disconnected(raw, run_prefill(path, body, headers))
            prefill_s = prefilled_s
            decode_request = dict(body, kv_transfer_params=params)
            try:
                if body.get("stream"):
                    return await unless_disconnected(
                        raw, stream_decode(path, decode_request, headers, started, prefilled_s))
                sent = time.monotonic()
                with decode.acquire() as instance:
                    decode_url = instance.url
                    answer = await unless_disconnected(
                        raw, post_json("decode", instance, path, decode_request, headers))
            except APIError as error:
                if decode_is_done(error):
                    in_background(hand_back(p_url, params, headers))
                raise
            metrics.observe("decode_seconds", time.monotonic() - sent)
        except APIError as error:
            metrics.inc("requests_total", outcome=error.code or "error")
            log_request(request_id, prefill_s, decode_url, started,
                        f"{error.code or 'error'} ({error.message})")
            raise
        metrics.inc("requests_total", outcome="ok")
        log_request(request_id, prefill_s, decode_url, started, "ok")
        figures = answer.get("kvlink")
        if isinstance(figures, dict):
            figures["prefill_s"] = prefill_s
        return JSONResponse(answer, headers={PREFILL_HEADER: f"{prefilled_s:.6f}"})

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await route(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await route(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        with decode.acquire() as instance:
            try:
                response = await client.get(instance.url + "/v1/models")
            except Exception as error:
                raise transport_error("decode", instance.url, error, timeout_s) from error
        if response.status_code != 200:
            raise status_error("decode", instance.url, response)
        return JSONResponse(response.json())

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "prefill": prefill.describe(), "decode": decode.describe()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
