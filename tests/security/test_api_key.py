"""API keys at the router's edge: missing, wrong and right keys over HTTP and gRPC, the open
health endpoints, reflection off by default, the CLI plumbing (flag, env, several keys),
and the client and `pdserve generate` sending the key."""

from __future__ import annotations

import argparse
import hmac

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from router.auth import ApiKeys
from router.client import GenerationClient
from tests.router_fakes import TOKENS, ScriptedBackend, make_router_model_dir
from tests.security.edge_server import GREEDY, EdgeServer

KEYS = ("key-one", "key-two")


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_router_model_dir(tmp_path_factory.mktemp("router-model"))


@pytest.fixture(scope="module")
def edge(model_dir):
    with EdgeServer(model_dir, ScriptedBackend(TOKENS), api_keys=KEYS) as server:
        yield server


@pytest.mark.parametrize("headers", [
    {}, bearer("wrong"), bearer("key-one-and-more"), bearer("key-on"), bearer(""),
    {"Authorization": "Basic a2V5LW9uZQ=="}, {"Authorization": "key-one"},
    {"X-Api-Key": "key-one"},
], ids=["missing", "wrong", "longer", "prefix", "empty", "basic", "no-scheme", "other-header"])
@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"),
                                         ("GET", "/v1/models"), ("GET", "/v1/nothing")])
def test_http_without_a_valid_key_is_401(edge, headers, method, path):
    before = len(edge.backend.requests)
    status, body, resp_headers = edge.http(method, path, GREEDY if method == "POST" else None,
                                           headers)
    assert status == 401
    assert body == {"error": {"message": body["error"]["message"],
                              "type": "invalid_request_error", "param": None, "code": 401}}
    assert "Bearer" in body["error"]["message"]
    assert resp_headers.get("WWW-Authenticate") == "Bearer"
    assert len(edge.backend.requests) == before


@pytest.mark.parametrize("key", KEYS)
def test_http_with_either_key_is_served(edge, key):
    status, body, _ = edge.http("POST", "/v1/completions", GREEDY, bearer(key))
    assert status == 200 and body["choices"][0]["text"]
    status, models, _ = edge.http("GET", "/v1/models", None, {"Authorization": f"bearer {key}"})
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]


def test_http_health_and_metrics_stay_open(edge):
    status, body, _ = edge.http("GET", "/health")
    assert status == 200 and body == {"status": "ok"}
    import urllib.request
    with urllib.request.urlopen(edge.http_url + "/metrics", timeout=30) as resp:
        assert resp.getcode() == 200
        assert b"pdserve_router_requests_total" in resp.read()


def _grpc_generate(address: str, metadata) -> grpc.RpcError | str:
    with GenerationClient(address, timeout=30, api_key="") as client:
        client.metadata = metadata
        try:
            return client.generate("Hello", max_tokens=4, temperature=0).text
        except grpc.RpcError as err:
            return err


@pytest.mark.parametrize("metadata", [
    None, (("authorization", "Bearer wrong"),), (("authorization", "key-one"),),
    (("authorization", "Bearer key-one-x"),), (("x-api-key", "key-one"),),
], ids=["missing", "wrong", "no-scheme", "longer", "other-key"])
def test_grpc_without_a_valid_key_is_unauthenticated(edge, metadata):
    before = len(edge.backend.requests)
    err = _grpc_generate(edge.grpc_address, metadata)
    assert isinstance(err, grpc.RpcError)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in err.details()
    with grpc.insecure_channel(edge.grpc_address) as ch:     # ListModels too
        from protos import api_pb2, api_pb2_grpc
        with pytest.raises(grpc.RpcError) as info:
            api_pb2_grpc.GenerationStub(ch).ListModels(api_pb2.ListModelsRequest(),
                                                       metadata=metadata, timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(edge.backend.requests) == before


@pytest.mark.parametrize("key", KEYS)
def test_grpc_with_either_key_is_served(edge, key):
    with GenerationClient(edge.grpc_address, timeout=30, api_key=key) as client:
        assert client.list_models() == ["tiny"]
        assert client.generate("Hello", max_tokens=4, temperature=0).text != ""


def test_grpc_client_takes_the_key_from_the_environment(edge, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", " key-two , key-one")
    with GenerationClient(edge.grpc_address, timeout=30) as client:
        assert client.metadata == (("authorization", "Bearer key-two"),)
        assert client.list_models() == ["tiny"]


def test_grpc_health_is_open_and_reflection_is_off_by_default(edge):
    with grpc.insecure_channel(edge.grpc_address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                    timeout=30)
        assert resp.status in (health_pb2.HealthCheckResponse.SERVING,
                               health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError) as info:
            list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=(("authorization", "Bearer key-one"),), timeout=30))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_when_on_needs_the_key(model_dir):
    request = [reflection_pb2.ServerReflectionRequest(list_services="")]
    with EdgeServer(model_dir, ScriptedBackend(TOKENS), api_keys=KEYS,
                    reflection_on=True) as server, grpc.insecure_channel(
                        server.grpc_address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ServerReflectionInfo(iter(request), timeout=30))
        names = [s.name for r in stub.ServerReflectionInfo(
            iter(request), metadata=(("authorization", "Bearer key-two"),), timeout=30)
            for s in r.list_services_response.service]
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "pdserve.v1.Generation" in names


def test_no_keys_means_open_and_metrics_can_be_turned_off(model_dir):
    with EdgeServer(model_dir, ScriptedBackend(TOKENS), metrics_on=False) as server:
        status, _, _ = server.http("POST", "/v1/completions", GREEDY)
        assert status == 200
        status, body, _ = server.http("GET", "/metrics")
        assert status == 404 and body["error"]["code"] == 404


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    keys = ApiKeys(["a1,b2", " c3 "])
    assert len(keys) == 3 and "a1" not in repr(keys)
    assert keys.allows("Bearer a1") and keys.allows("bearer  c3 ")
    assert not keys.allows("Bearer a") and not keys.allows(None) and not keys.allows("Bearer")
    # every allows() with a Bearer value compared against all three keys, bytes to bytes
    assert len(calls) == 3 * 4 and all(isinstance(a, bytes) for a, _ in calls)
    assert ApiKeys().allows(None) and not ApiKeys()
    with pytest.raises(ValueError, match="visible ASCII"):
        ApiKeys(["has space"])
    with pytest.raises(ValueError, match="visible ASCII"):
        ApiKeys(["k\u00e9y"])


def _parse(argv: list[str]) -> argparse.Namespace:
    from launch.cli import build_parser
    return build_parser().parse_args(argv)


def test_router_cli_flags(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_METRICS", raising=False)
    monkeypatch.delenv("PDSERVE_GRPC_REFLECTION", raising=False)
    args = _parse(["router"])
    assert args.api_key == [] and args.metrics is True and args.grpc_reflection is False
    args = _parse(["router", "--api-key", "a", "--api-key", "b,c", "--no-metrics",
                   "--grpc-reflection"])
    assert args.api_key == ["a", "b", "c"] and args.metrics is False
    assert args.grpc_reflection is True
    monkeypatch.setenv("PDSERVE_API_KEY", "x, y")
    monkeypatch.setenv("PDSERVE_METRICS", "off")
    args = _parse(["router"])
    assert args.api_key == ["x", "y"] and args.metrics is False
    assert _parse(["router", "--api-key", "z"]).api_key == ["z"]       # the flag wins
    help_text = _parse_help(["router", "--help"])
    assert "[env PDSERVE_API_KEY]" in help_text and "x, y" not in help_text


def _parse_help(argv: list[str]) -> str:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        _parse(argv)
    return out.getvalue()


def test_pdserve_generate_sends_the_key(edge, monkeypatch, capsys):
    from launch.cli_common import CliError
    from launch.commands import generate

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    args = _parse(["generate", "--router", edge.grpc_address, "--max-tokens", "4",
                   "--api-key", "key-one", "Hello"])
    assert generate.run(args) == 0
    assert capsys.readouterr().out.strip() != ""
    args = _parse(["generate", "--router", edge.grpc_address, "Hello"])
    with pytest.raises(CliError, match="UNAUTHENTICATED"):
        generate.run(args)
    monkeypatch.setenv("PDSERVE_API_KEY", "key-two")
    args = _parse(["generate", "--router", edge.grpc_address, "--max-tokens", "4", "Hello"])
    assert generate.run(args) == 0
