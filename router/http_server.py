"""OpenAI-compatible HTTP front (aiohttp): /v1/completions, /v1/chat/completions (whole or
as server-sent events), /v1/models, /health, /metrics (unless turned off).

The edge: with API keys configured every path but /health (and /metrics, for scrapers)
needs `Authorization: Bearer <key>`; a body over `max_body_bytes` is 413; the body is
decoded, validated and tokenized in a worker thread, so a huge or slow one cannot stall the
event loop (and with it /health, the liveness probe). Every error is an OpenAI error body.

A streamed request is started before the response headers go out: a failure that happens
before the first token (no node, every node full) still gets its proper status and an
OpenAI error body rather than a 200 stream carrying an error.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from cluster import tracing
from router.auth import OPEN_HTTP_PATHS, UNAUTHENTICATED_MESSAGE, ApiKeys
from router.errors import (
    InvalidRequest,
    NoNodeAvailable,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    RouterError,
    Unauthenticated,
)
from router.json_body import decode_json
from router.metrics import CONTENT_TYPE
from router.openai_format import SSE_DONE, ChunkWriter, error_event, full_response
from router.rate_limit import RateLimiter, retry_after_s
from router.requests import (
    ParsedRequest,
    check_request_id,
    new_request_id,
    parse_chat,
    parse_completion,
)
from router.service import RouterService

log = logging.getLogger("pdserve.router")

SERVICE_KEY: web.AppKey[RouterService] = web.AppKey("service", RouterService)
BODY_LIMIT_KEY: web.AppKey[int] = web.AppKey("max_body_bytes", int)
MAX_BODY_BYTES = 32 * 1024 * 1024
NOT_READY_RETRY_S = 1           # /health's Retry-After while no unit is registered


def error_response(err: RouterError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(err, Unauthenticated) else None
    if isinstance(err, Overloaded | NoNodeAvailable):     # 429 / 503: when to come back
        headers = {"Retry-After": str(err.retry_after_s)}
    return web.json_response(err.to_openai(), status=err.http_status, headers=headers)


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"the request body is larger than the "
                              f"{request.app[BODY_LIMIT_KEY]} bytes accepted") from None


def _log_id(rid: str | None) -> str:
    try:
        return check_request_id(rid)
    except InvalidRequest:              # not echoed into the log: it may be anything
        return new_request_id()


def _parse(raw: bytes, kind: str, service: RouterService, rid: str | None) -> ParsedRequest:
    """Bytes -> ParsedRequest. Blocking (JSON, validation, tokenizer): runs in a thread."""
    parse = parse_chat if kind == "chat" else parse_completion
    return parse(decode_json(raw), service.info, service.tokenizer, rid)


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    endpoint = "chat" if kind == "chat" else "completions"
    rid = request.headers.get("X-Request-Id")
    try:
        raw = await _read_body(request)
        req = await asyncio.to_thread(_parse, raw, kind, service, rid)
    except RouterError as err:
        service.metrics.requests.labels(endpoint, str(err.http_status)).inc()
        log.info("[%s] rejected: %s", _log_id(rid), err.message)
        return error_response(err)
    run = service.run(req, endpoint)
    run.trace_parent = tracing.from_carrier(request.headers.items())   # tracing on: a parent
    events = run.events()
    try:
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        except RouterError as err:
            return error_response(err)
        if not req.stream:
            if first is not None:
                async for _ in events:
                    pass
            return web.json_response(full_response(req, run.results, service.tokenizer),
                                     headers={"X-Request-Id": req.request_id})
        return await _stream(request, req, run, events, first)
    finally:
        await events.aclose()


async def _stream(request, req, run, events, first) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache",
                                       "X-Request-Id": req.request_id})
    await resp.prepare(request)
    writer = ChunkWriter(req, service.tokenizer)
    for i in range(len(req.prompts)):
        head = writer.start(i)
        if head is not None:
            await resp.write(head)
    try:
        if first is not None:
            chunk = writer.delta(*first)
            if chunk is not None:
                await resp.write(chunk)
            async for index, delta in events:
                chunk = writer.delta(index, delta)
                if chunk is not None:
                    await resp.write(chunk)
        if req.include_usage:
            await resp.write(writer.usage_chunk(run.results))
    except RouterError as err:       # after the headers: the error travels as an event
        await resp.write(error_event(err.to_openai()))
    except ConnectionResetError:
        log.info("[%s] client went away", req.request_id)
        return resp
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def models(request: web.Request) -> web.Response:
    info = request.app[SERVICE_KEY].info
    return web.json_response({"object": "list", "data": [
        {"id": info.name, "object": "model", "created": int(time.time()),
         "owned_by": "pdserve", "max_model_len": info.max_model_len}]})


async def health(request: web.Request) -> web.Response:
    """200 once the router can serve (a prefill + decode pair or an aggregated node). The
    body names nodes that serve without their C++ CPU kernels (slower, not down)."""
    service = request.app[SERVICE_KEY]
    if service.backend.ready():
        body: dict = {"status": "ok"}
        pool = getattr(service.backend, "pool", None)
        degraded = {n.node_id: f"CPU kernels not built, the torch path runs: {n.kernel_error}"
                    for n in (pool.all() if pool is not None else []) if n.kernel_error}
        if degraded:
            body["degraded"] = degraded
        return web.json_response(body)
    return web.json_response({"status": "not ready: no prefill + decode pair and no "
                                        "aggregated node is registered"},
                             status=503, headers={"Retry-After": str(NOT_READY_RETRY_S)})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SERVICE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


@web.middleware
async def _json_errors(request: web.Request, handler):
    """Unknown routes, wrong methods and internal errors answer with an OpenAI body too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response({"error": {"message": f"{exc.reason}: {request.method} "
                                            f"{request.path[:200]}",
                                            "type": "invalid_request_error",
                                            "param": None, "code": exc.status}},
                                 status=exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path[:200])
        return error_response(RouterError("internal error"))


def _require_key(keys: ApiKeys, open_paths: frozenset[str], limiter: RateLimiter | None):
    @web.middleware
    async def check(request: web.Request, handler):
        # Checked before the route is resolved to a handler: unknown paths answer 401 too,
        # so the edge does not tell an unauthenticated client which routes exist.
        if request.path in open_paths:
            return await handler(request)
        key = keys.match(request.headers.get("Authorization"))
        if key is None:
            return error_response(Unauthenticated(UNAUTHENTICATED_MESSAGE))
        wait = limiter.take(key) if limiter is not None else 0.0
        if wait > 0:            # before the body is read: a refused call costs nothing
            return error_response(RateLimited(limiter.message(wait),
                                              retry_after_s=retry_after_s(wait)))
        return await handler(request)
    return check


def make_app(service: RouterService | None, api_keys: ApiKeys | None = None,
             metrics_on: bool = True, max_body_bytes: int = MAX_BODY_BYTES,
             limiter: RateLimiter | None = None) -> web.Application:
    """limiter: per-key rate limits (only with api_keys: the buckets are per key)."""
    middlewares = [_json_errors]
    if limiter is not None and not api_keys:
        raise ValueError("a rate limit needs API keys: it is counted per key")
    if api_keys:
        # /metrics stays open for Prometheus scrapers (turn it off with --no-metrics).
        middlewares.append(_require_key(api_keys, OPEN_HTTP_PATHS | {"/metrics"}, limiter))
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[SERVICE_KEY] = service
    app[BODY_LIMIT_KEY] = max_body_bytes
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    if metrics_on:
        app.router.add_get("/metrics", metrics)
    return app
