"""Aggregated mode end to end: real node processes, real gRPC, a real etcd on 127.0.0.1.

- An aggregated node alone (`pdserve aggregated`, what `pdserve up --aggregated` starts)
  gives the single-node LLM's greedy tokens and text for a concurrent mixed batch (HTTP
  whole and SSE, chat, gRPC whole and streamed, a stop string), and its blocks come back.
- The router's readiness follows registration: 503 + Retry-After (HTTP) / UNAVAILABLE + a
  retry-after trailer (gRPC) and NOT_SERVING health before any node, 200 / SERVING once an
  aggregated node or a prefill + decode pair is registered, 503 again when it leaves; a
  cluster with both kinds of unit serves exact output.
- The roles refuse each other's calls clearly: a decode node refuses self_prefill, an
  aggregated node a reservation (FAILED_PRECONDITION naming the role).
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.sampling_params import SamplingParams
from launch.local_cluster import LocalCluster, LocalClusterConfig
from protos import api_pb2, api_pb2_grpc, node_pb2, node_pb2_grpc
from tests.integration.router_harness import (
    LEASE_TTL,
    MODEL,
    NODE_ARGS,
    NUM_BLOCKS,
    Req,
    assert_batch_equal,
    metric_values,
    mixed_batch,
    reference,
    run_batch,
    scrape,
    start_cluster,
    stop_request,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)
NODE_START_S = 180          # a node process loading its model on a loaded 2-core machine


@pytest.fixture(scope="module")
def aggregated(folder, tmp_path_factory):
    c = start_cluster(folder, tmp_path_factory.mktemp("cluster-aggregated"), prefill=0,
                      decode=0, num_aggregated=1)
    yield c
    c.stop()


def test_an_aggregated_node_equals_single_node_llm_for_a_mixed_concurrent_batch(
        aggregated, llm):
    assert [n.role for n in aggregated.nodes] == ["aggregated"]
    reqs = mixed_batch(lambda: stop_request(llm))
    outs = asyncio.run(run_batch(aggregated.http_url, aggregated.grpc_address, MODEL, reqs))
    assert_batch_equal(llm, reqs, outs)
    assert outs[-1][2] == "stop"
    # the router knows the one node, and once idle its blocks are all back
    free = lambda: metric_values(scrape(aggregated.http_url), "pdserve_node_free_kv_blocks")
    assert wait_for(lambda: free() == {"aggregated-0": NUM_BLOCKS - 1}, 10), free()


# ---- readiness and the roles' refusals ----------------------------------------------------
def _http(url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a GET, or of a POST when `body` is given."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def _health_status(http_url: str) -> int:
    return _http(f"{http_url}/health")[0]


def _grpc_health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=10).status


def _grpc_generate_error(address: str) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch:
        stub = api_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stub.Generate(api_pb2.GenerateRequest(text="Hello"), timeout=120):
                pass
    return err.value


def _node_decode_error(address: str, self_prefill: bool) -> grpc.RpcError:
    """A Decode call straight to a node; it must be refused."""
    from cluster.proto_convert import sampling_to_proto

    with grpc.insecure_channel(address) as ch:
        stub = node_pb2_grpc.DecodeNodeStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stub.Decode(node_pb2.ReserveRequest(
                    request_id="role-check", prompt_token_ids=[5, 6, 7],
                    sampling=sampling_to_proto(SamplingParams(max_tokens=2)),
                    self_prefill=self_prefill), timeout=60):
                pass
    return err.value


def _completion_matches(http_url: str, llm) -> None:
    req = Req("http", "Hello world, this is a test", 6)
    status, _, body = _http(f"{http_url}/v1/completions", {
        "model": MODEL, "prompt": req.prompt, "max_tokens": 6, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == reference(llm, req)[1]


def _start(cluster: LocalCluster, *roles: str):
    nodes = [cluster.add_node(role) for role in roles]
    cluster.wait_ready(nodes, NODE_START_S)
    return nodes


def _drain(node) -> None:
    node.signal(signal.SIGTERM)
    assert node.wait(60) == 0, node.log_tail()


def test_readiness_follows_registration_and_roles_refuse_each_others_calls(folder, llm,
                                                                           tmp_path):
    cluster = LocalCluster(LocalClusterConfig(
        model=str(folder), num_prefill=0, num_decode=0, num_aggregated=1, http_port=0,
        grpc_port=0, cluster="ready", node_args=NODE_ARGS, lease_ttl=LEASE_TTL,
        run_dir=tmp_path, tls=False, restart_nodes=False,
        router_args=["--queue-timeout", "1"]))
    try:
        cluster.etcd.start()
        cluster.router = cluster.add_router(0, 0)
        cluster.wait_ready([cluster.router], 120)
        addresses = json.loads(cluster.router.ready())
        http, grpc_address = addresses["http"], addresses["grpc"]
        serving = health_pb2.HealthCheckResponse.SERVING

        # no node: not ready, and a request fails (after --queue-timeout) saying when to retry
        status, headers, body = _http(f"{http}/health")
        assert status == 503 and headers.get("Retry-After") == "1", (status, headers, body)
        status, headers, body = _http(f"{http}/v1/completions", {
            "model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert status == 503, body
        assert int(headers["Retry-After"]) >= 1
        assert body["error"]["type"] == "service_unavailable"
        assert "no prefill node" in body["error"]["message"]
        err = _grpc_generate_error(grpc_address)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert int(dict(err.trailing_metadata())["retry-after"]) >= 1
        assert _grpc_health(grpc_address) != serving

        # an aggregated node registers: ready, and it serves
        (agg,) = _start(cluster, "aggregated")
        assert wait_for(lambda: _health_status(http) == 200, 60)
        assert wait_for(lambda: _grpc_health(grpc_address) == serving, 10)
        _completion_matches(http, llm)
        refused = _node_decode_error(agg.ready(), self_prefill=False)
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "aggregated node" in refused.details()

        # it leaves (SIGTERM: deregisters, drains): not ready again
        _drain(agg)
        assert wait_for(lambda: _health_status(http) == 503, 30)
        assert wait_for(lambda: _grpc_health(grpc_address) != serving, 10)

        # a prefill + decode pair: ready, and it serves
        pre, dec = _start(cluster, "prefill", "decode")
        assert wait_for(lambda: _health_status(http) == 200, 60)
        _completion_matches(http, llm)
        refused = _node_decode_error(dec.ready(), self_prefill=True)
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "decode-only node" in refused.details() and "aggregated" in refused.details()

        # both kinds of unit at once: every output still exact
        _start(cluster, "aggregated")
        reqs = mixed_batch(lambda: stop_request(llm))
        outs = asyncio.run(run_batch(http, grpc_address, MODEL, reqs))
        assert_batch_equal(llm, reqs, outs)

        # the pair's decode node and the aggregated node leave: a prefill node alone
        # cannot serve
        for node in (dec, cluster.nodes[-1]):
            _drain(node)
        assert wait_for(lambda: _health_status(http) == 503, 30)
        assert pre.alive()
    finally:
        cluster.stop()
