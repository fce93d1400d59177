"""TLS on the router's public listeners (--public-tls-cert/--public-tls-key): HTTPS and gRPC
over TLS serve a client that trusts the router's CA (with the API key), and a plaintext
client or one that trusts another CA gets nothing."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import grpc
import pytest

from cluster.tls import make_ca, make_leaf
from router.client import GenerationClient
from router.public_tls import PublicTls
from tests.router_fakes import TOKENS, ScriptedBackend, make_router_model_dir
from tests.security.edge_server import GREEDY, EdgeServer

KEY = "public-key-1"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("public-tls")
    ca_cert, ca_key = make_ca("test public CA")
    cert, key = make_leaf(ca_cert, ca_key, "router.example")
    other_ca, _ = make_ca("some other CA")
    for name, data in (("ca.crt", ca_cert), ("router.crt", cert), ("router.key", key),
                       ("other.crt", other_ca)):
        (d / name).write_bytes(data)
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory, certs):
    model_dir = make_router_model_dir(tmp_path_factory.mktemp("router-model"))
    tls = PublicTls(str(certs / "router.crt"), str(certs / "router.key"))
    with EdgeServer(model_dir, ScriptedBackend(TOKENS), api_keys=(KEY,),
                    public_tls=tls) as s:
        yield s


def _post(url: str, context: ssl.SSLContext | None) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(GREEDY).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30, context=context) as resp:
        return resp.status, json.loads(resp.read())


def test_https_serves_a_client_that_trusts_the_router_ca(server, certs):
    assert server.http_url.startswith("https://")
    status, body = _post(server.http_url, ssl.create_default_context(
        cafile=str(certs / "ca.crt")))
    assert status == 200 and body["choices"][0]["text"]


def test_https_refuses_plaintext_and_other_cas(server, certs):
    plain = server.http_url.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        _post(plain, None)
    with pytest.raises(urllib.error.URLError) as info:
        _post(server.http_url, ssl.create_default_context(cafile=str(certs / "other.crt")))
    assert isinstance(info.value.reason, ssl.SSLCertVerificationError)


def test_grpc_over_tls_with_the_client(server, certs):
    with GenerationClient(server.grpc_address, timeout=30, api_key=KEY,
                          tls_ca=str(certs / "ca.crt")) as client:
        out = client.generate("Hello", max_tokens=4, temperature=0)
    assert out.token_ids == TOKENS[:4]
    for tls_ca in (None, str(certs / "other.crt")):       # plaintext; untrusted router
        with GenerationClient(server.grpc_address, timeout=10, api_key=KEY,
                              tls_ca=tls_ca) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.generate("Hello", max_tokens=4)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_flags_go_together(certs):
    with pytest.raises(ValueError, match="go together"):
        PublicTls.from_args(str(certs / "router.crt"), None)
    assert PublicTls.from_args(None, None) is None
