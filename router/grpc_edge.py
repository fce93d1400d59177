"""The gRPC front's edge, as one server interceptor: the API key, its rate limit
(router/rate_limit.py), and requests whose bytes do not decode.

grpc.aio deserializes a request before any servicer code runs, and a deserializer that
raises ends the call with a status the client cannot act on (not INVALID_ARGUMENT). So for
unary-request methods the interceptor swaps in a deserializer that turns a decode failure
into a marker, and wraps the method so the marker is answered INVALID_ARGUMENT naming the
request. A call without a valid key never reaches the real deserializer: its bytes are not
parsed at all.
"""

from __future__ import annotations

import grpc

from router.auth import OPEN_GRPC_SERVICES, UNAUTHENTICATED_MESSAGE, ApiKeys
from router.rate_limit import RateLimiter, retry_after_s

# The gRPC default, stated: a larger message is refused by gRPC core with RESOURCE_EXHAUSTED
# before any of our code (or the protobuf parser) sees it.
MAX_GRPC_MESSAGE_BYTES = 4 * 1024 * 1024


class Undecodable:
    """A request whose bytes are not a valid message of the method's type."""

    def __init__(self, reason: str):
        self.reason = reason


def _metadata(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for k, v in details.invocation_metadata or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None


def _with_behavior(handler, behavior, deserializer):
    """`handler` with its one behavior replaced (and the request deserializer)."""
    kind = ("stream_stream" if handler.request_streaming else "unary_stream") \
        if handler.response_streaming else \
        ("stream_unary" if handler.request_streaming else "unary_unary")
    return handler._replace(request_deserializer=deserializer, **{kind: behavior})


def _deny(handler, code: grpc.StatusCode, message: str, trailers: tuple = ()):
    if handler.response_streaming:
        async def behavior(request, context):
            await context.abort(code, message, trailing_metadata=trailers)
            yield  # pragma: no cover - abort raises; this only makes it a generator
    else:
        async def behavior(request, context):
            await context.abort(code, message, trailing_metadata=trailers)
    # No deserializer: the unauthenticated request's bytes are never parsed.
    return _with_behavior(handler, behavior, None)


def _guard_decode(handler, method: str):
    parse = handler.request_deserializer
    if handler.request_streaming or parse is None:
        return handler

    def deserialize(raw: bytes):
        try:
            return parse(raw)
        except Exception as exc:  # noqa: BLE001 - any parser failure is the client's bytes
            return Undecodable(f"{type(exc).__name__}: {str(exc)[:200]}")

    message = f"the {method} request could not be decoded as its protobuf message"
    inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

    if handler.response_streaming:
        async def behavior(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{message} ({request.reason})")
            async for item in inner(request, context):
                yield item
    else:
        async def behavior(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{message} ({request.reason})")
            return await inner(request, context)
    return _with_behavior(handler, behavior, deserialize)


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys, limiter: RateLimiter | None = None):
        if limiter is not None and not keys:
            raise ValueError("a rate limit needs API keys: it is counted per key")
        self.keys = keys
        self.limiter = limiter

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        service = details.method.strip("/").split("/", 1)[0]
        if service in OPEN_GRPC_SERVICES:
            return handler
        if not self.keys:
            return _guard_decode(handler, details.method)
        key = self.keys.match(_metadata(details, "authorization"))
        if key is None:
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED,
                         UNAUTHENTICATED_MESSAGE.replace("Authorization", "authorization"))
        wait = self.limiter.take(key) if self.limiter is not None else 0.0
        if wait > 0:            # as HTTP's Retry-After, in a trailer clients can read
            return _deny(handler, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         self.limiter.message(wait),
                         (("retry-after", str(retry_after_s(wait))),))
        return _guard_decode(handler, details.method)
