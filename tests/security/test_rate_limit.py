"""Per-API-key rate limits at the router's edge (router/rate_limit.py, `--rate-limit`): a
token bucket per key, shared by the HTTP and gRPC fronts; over it HTTP 429 with
Retry-After and gRPC RESOURCE_EXHAUSTED with a retry-after trailer, nothing reaching the
backend; keys never share a bucket; /health and gRPC health are never counted. The clock
is the test's, so no test sleeps."""

from __future__ import annotations

import argparse

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.client import GenerationClient
from router.rate_limit import RateLimit, RateLimiter
from router.server import RouterConfig
from tests.router_fakes import TOKENS, ScriptedBackend, make_router_model_dir
from tests.security.edge_server import GREEDY, EdgeServer

KEYS = ("key-one", "key-two")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_router_model_dir(tmp_path_factory.mktemp("router-model"))


@pytest.fixture
def edge(model_dir):
    """1 call a second, bursts of 2, per key; the clock stands still until a test moves it."""
    clock = Clock()
    limiter = RateLimiter(RateLimit(1.0, 2), clock=clock)
    with EdgeServer(model_dir, ScriptedBackend(TOKENS), api_keys=KEYS,
                    limiter=limiter) as server:
        server.clock = clock
        yield server


def _grpc_generate(edge, key: str):
    """(text or the RpcError, trailing metadata as a dict)."""
    with GenerationClient(edge.grpc_address, timeout=30, api_key=key) as client:
        try:
            return client.generate("Hello", max_tokens=4, temperature=0).text, {}
        except grpc.RpcError as err:
            return err, dict(err.trailing_metadata() or ())


def test_http_past_the_burst_is_429_with_retry_after_and_reaches_no_node(edge):
    for _ in range(2):
        assert edge.http("POST", "/v1/completions", GREEDY, bearer("key-one"))[0] == 200
    before = len(edge.backend.requests)
    status, body, headers = edge.http("POST", "/v1/completions", GREEDY, bearer("key-one"))
    assert status == 429
    assert headers.get("Retry-After") == "1"
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == 429
    assert "rate limit exceeded for this API key (1/s, burst 2)" in body["error"]["message"]
    assert len(edge.backend.requests) == before
    # every path that needs the key counts; the open ones never do
    assert edge.http("GET", "/v1/models", None, bearer("key-one"))[0] == 429
    for _ in range(5):
        assert edge.http("GET", "/health")[0] in (200, 503)


def test_keys_do_not_share_a_bucket(edge):
    for _ in range(2):
        assert edge.http("POST", "/v1/completions", GREEDY, bearer("key-one"))[0] == 200
    assert edge.http("POST", "/v1/completions", GREEDY, bearer("key-one"))[0] == 429
    for _ in range(2):          # key-two's bucket is full: key-one's use cost it nothing
        assert edge.http("POST", "/v1/completions", GREEDY, bearer("key-two"))[0] == 200
    assert edge.http("POST", "/v1/completions", GREEDY, bearer("key-two"))[0] == 429
    # a wrong key is 401, not a draw on anyone's bucket
    assert edge.http("POST", "/v1/completions", GREEDY, bearer("key-three"))[0] == 401


def test_the_bucket_refills_at_the_rate(edge):
    for _ in range(2):
        assert edge.http("GET", "/v1/models", None, bearer("key-one"))[0] == 200
    assert edge.http("GET", "/v1/models", None, bearer("key-one"))[0] == 429
    edge.clock.now += 0.5                                   # half a token: still empty
    status, _, headers = edge.http("GET", "/v1/models", None, bearer("key-one"))
    assert (status, headers.get("Retry-After")) == (429, "1")
    edge.clock.now += 1.0                                   # one whole token back
    assert edge.http("GET", "/v1/models", None, bearer("key-one"))[0] == 200
    assert edge.http("GET", "/v1/models", None, bearer("key-one"))[0] == 429
    edge.clock.now += 60                                    # a quiet minute: the burst only
    for expected in (200, 200, 429):
        assert edge.http("GET", "/v1/models", None, bearer("key-one"))[0] == expected


def test_grpc_past_the_limit_is_resource_exhausted_with_a_retry_after_trailer(edge):
    assert _grpc_generate(edge, "key-one")[0] == _grpc_generate(edge, "key-one")[0]
    before = len(edge.backend.requests)
    err, trailers = _grpc_generate(edge, "key-one")
    assert isinstance(err, grpc.RpcError)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rate limit exceeded for this API key" in err.details()
    assert trailers.get("retry-after") == "1"
    assert len(edge.backend.requests) == before
    # one bucket per key across both fronts; health stays open
    assert edge.http("GET", "/v1/models", None, bearer("key-one"))[0] == 429
    assert isinstance(_grpc_generate(edge, "key-two")[0], str)
    with grpc.insecure_channel(edge.grpc_address) as ch:
        for _ in range(3):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)


def test_token_bucket_arithmetic():
    clock = Clock()
    limiter = RateLimiter(RateLimit(0.5, 3), clock=clock)
    assert [limiter.take(0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take(0) == pytest.approx(2.0)            # one token at 0.5/s
    assert limiter.take(1) == 0.0                           # another key, its own bucket
    clock.now += 1.0
    assert limiter.take(0) == pytest.approx(1.0)            # half a token so far
    clock.now += 1.0
    assert limiter.take(0) == 0.0
    assert limiter.refused == 2


@pytest.mark.parametrize("spec,want", [
    ("5", RateLimit(5.0, 5)), ("0.5", RateLimit(0.5, 1)), ("2:10", RateLimit(2.0, 10)),
    (" 1.5:1 ", RateLimit(1.5, 1))])
def test_rate_limit_spec(spec, want):
    assert RateLimit.parse(spec) == want


@pytest.mark.parametrize("spec,match", [("fast", "RPS or RPS:BURST"), ("1:x", "RPS or RPS:BURST"),
                                        ("0", "RPS must be a number > 0"),
                                        ("-1:2", "RPS must be a number > 0"),
                                        ("nan", "RPS must be a number > 0"),
                                        ("inf", "RPS must be a number > 0"),
                                        ("1:0", "BURST must be an integer >= 1")])
def test_bad_rate_limit_spec(spec, match):
    with pytest.raises(ValueError, match=match):
        RateLimit.parse(spec)


def test_the_router_flag_needs_api_keys(model_dir, monkeypatch):
    from launch.cli import build_parser
    from launch.cli_common import CliError
    from launch.commands import router as router_cmd

    with pytest.raises(ValueError, match="--rate-limit needs --api-key"):
        RouterConfig(model=str(model_dir), rate_limit=RateLimit(1.0, 1))
    RouterConfig(model=str(model_dir), rate_limit=RateLimit(1.0, 1), api_keys=KEYS)
    monkeypatch.setenv("PDSERVE_RATE_LIMIT", "3:6")
    args = build_parser().parse_args(["router"])
    assert RateLimit.parse(args.rate_limit) == RateLimit(3.0, 6)
    bad = argparse.Namespace(**{**vars(build_parser().parse_args(["router"])),
                                "model": str(model_dir), "rate_limit": "x"})
    with pytest.raises(CliError, match="RPS or RPS:BURST"):
        router_cmd.run(bad)
