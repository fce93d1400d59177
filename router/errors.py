"""Errors a client can cause or meet, with their HTTP status and gRPC code.

One exception type carries both mappings, so the HTTP and gRPC fronts cannot disagree on
what a failure means: 400 / INVALID_ARGUMENT for bad input, 401 / UNAUTHENTICATED without a
valid API key, 413 / RESOURCE_EXHAUSTED for a body over the size limit, 429 /
RESOURCE_EXHAUSTED when every node is full or an API key is over its rate limit, 503 /
UNAVAILABLE when no node can serve, 500 / INTERNAL when a request fails the same way on
consecutive attempts (a bug in the cluster that replaying will not cure). The 429s and
the 503 carry a retry delay: HTTP's `Retry-After` header, a `retry-after` trailer on gRPC.
"""

from __future__ import annotations


class RouterError(Exception):
    http_status = 500
    grpc_code = "INTERNAL"          # grpc.StatusCode member name (grpc imported lazily)
    error_type = "internal_error"   # OpenAI error body "type"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.http_status}}


class InvalidRequest(RouterError):
    http_status = 400
    grpc_code = "INVALID_ARGUMENT"
    error_type = "invalid_request_error"


class ModelNotFound(InvalidRequest):
    # OpenAI answers an unknown model with 404; the issue asks for 400, which is also what
    # vLLM's router gives. The body names the model and the ones served.
    error_type = "invalid_request_error"


class PayloadTooLarge(RouterError):
    http_status = 413
    grpc_code = "RESOURCE_EXHAUSTED"
    error_type = "invalid_request_error"


class Unauthenticated(RouterError):
    # OpenAI's 401 body has type invalid_request_error; the status says what went wrong.
    http_status = 401
    grpc_code = "UNAUTHENTICATED"
    error_type = "invalid_request_error"


class Overloaded(RouterError):
    http_status = 429
    grpc_code = "RESOURCE_EXHAUSTED"
    error_type = "rate_limit_error"

    def __init__(self, message: str, param: str | None = None, retry_after_s: int = 1):
        super().__init__(message, param)
        self.retry_after_s = retry_after_s      # the HTTP Retry-After header


class RateLimited(Overloaded):
    """An API key over its --rate-limit (router/rate_limit.py)."""


class NoNodeAvailable(RouterError):
    """No unit can serve (none registered yet, all restarting, draining or refusing): the
    client should come back, so it is told when (nodes register within seconds)."""
    http_status = 503
    grpc_code = "UNAVAILABLE"
    error_type = "service_unavailable"

    def __init__(self, message: str, param: str | None = None, retry_after_s: int = 1):
        super().__init__(message, param)
        self.retry_after_s = retry_after_s      # the HTTP Retry-After header


class RepeatedFailure(RouterError):
    """Consecutive attempts of one request failed with the same cause on different tries:
    replaying it again would fail the same way, so the client gets a 500 naming the cause
    at once (a bug in the cluster, not a busy or missing node)."""
    http_status = 500
    grpc_code = "INTERNAL"
    error_type = "internal_error"


class NodeFailure(Exception):
    """A node call failed in a way that says the node (not the request) is the problem:
    connection refused, UNAVAILABLE, a broken stream. The router drops the node and replays
    the request on another pair."""

    def __init__(self, node_id: str, message: str):
        super().__init__(f"node {node_id}: {message}")
        self.node_id = node_id
