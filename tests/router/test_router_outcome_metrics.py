"""The router's outcome metrics, read back through prometheus_client's own text parser:
attempt failures by the failing role and reason (a node that died: node_down, and the
request replayed; a refusal: its gRPC code), the end-to-end latency histogram and finish
reasons of requests that succeeded, and the ready nodes of each role (failed ones
excluded). Scripted gRPC nodes at the boundary (tests/router/test_router_pd_flow.py)."""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client.parser import text_string_to_metric_families

from engine.tokenizer import Tokenizer
from router.metrics import RouterMetrics
from router.model_info import ModelInfo
from router.node_pool import NodePool, NodeState
from router.requests import parse_completion
from router.service import RouterService
from tests.router.pd_fakes import PROMPT, Shared, _cluster, _collect, _expected, _run
from tests.router_fakes import TOKENS, ScriptedBackend, make_router_model_dir


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the rendered text."""
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def failures(metrics: RouterMetrics) -> dict[tuple[str, str], float]:
    return {(dict(labels)["role"], dict(labels)["reason"]): v
            for (name, labels), v in samples(metrics).items()
            if name == "pdserve_router_attempt_failures_total"}


def test_a_decode_node_dying_mid_stream_counts_a_decode_node_down_and_a_replay():
    async def main():
        shared = Shared()
        _, backend, servers = await _cluster(shared, [{"die_after": 3}, {}], [{}, {}])
        tokens, _ = await _collect(backend, "r1", PROMPT, 8)
        for s in servers:
            await s.stop(None)
        await backend.close()
        return tokens, backend.metrics

    tokens, metrics = _run(main())
    assert tokens == _expected(PROMPT, 8)
    assert failures(metrics) == {("decode", "node_down"): 1.0}
    assert samples(metrics)[("pdserve_router_replays_total", ())] == 1.0


def test_a_decode_node_aborting_mid_stream_counts_a_replay():
    """A decode node that aborts its requests as it goes (ABORTED: a lost tensor-parallel
    rank) is refused, not dropped, but the request is still replayed with its streamed
    tokens on another node: that is a replay too."""
    async def main():
        shared = Shared()
        _, backend, servers = await _cluster(
            shared, [{"die_after": 3, "die_code": grpc.StatusCode.ABORTED}, {}], [{}, {}])
        tokens, _ = await _collect(backend, "r1a", PROMPT, 8)
        for s in servers:
            await s.stop(None)
        await backend.close()
        return tokens, backend.metrics

    tokens, metrics = _run(main())
    assert tokens == _expected(PROMPT, 8)
    assert failures(metrics) == {("decode", "aborted"): 1.0}
    assert samples(metrics)[("pdserve_router_replays_total", ())] == 1.0


def test_a_prefill_node_failing_counts_on_the_prefill_side():
    async def main():
        shared = Shared()
        _, backend, servers = await _cluster(shared, [{}], [{"fail": True}, {}])
        await _collect(backend, "r2", PROMPT, 4)
        for s in servers:
            await s.stop(None)
        await backend.close()
        return backend.metrics

    assert failures(_run(main())) == {("prefill", "node_down"): 1.0}


def test_a_full_decode_node_counts_a_refusal_by_its_code_and_no_replay():
    async def main():
        shared = Shared()
        _, backend, servers = await _cluster(shared, [{"full": True}, {}], [{}])
        tokens, _ = await _collect(backend, "r3", PROMPT, 4)
        for s in servers:
            await s.stop(None)
        await backend.close()
        return tokens, backend.metrics

    tokens, metrics = _run(main())
    assert tokens == _expected(PROMPT, 4)
    assert failures(metrics) == {("decode", "resource_exhausted"): 1.0}
    assert samples(metrics)[("pdserve_router_replays_total", ())] == 0.0


def test_ready_nodes_by_role_follow_the_pool_and_leave_out_failed_nodes():
    pool = NodePool()
    for node_id, role in [("p0", "prefill"), ("d0", "decode"), ("d1", "decode"),
                          ("a0", "aggregated")]:
        pool.upsert(NodeState(node_id, role, f"127.0.0.1:{len(node_id)}", incarnation="x"))
    metrics = RouterMetrics(pool)
    ready = lambda: {dict(labels)["role"]: v for (name, labels), v in samples(metrics).items()
                     if name == "pdserve_router_ready_nodes"}
    assert ready() == {"prefill": 1.0, "decode": 2.0, "aggregated": 1.0}
    pool.mark_failed("d0")
    assert ready() == {"prefill": 1.0, "decode": 1.0, "aggregated": 1.0}


def test_a_finished_request_observes_end_to_end_latency_and_its_finish_reason(tmp_path):
    model_dir = make_router_model_dir(tmp_path)
    info = ModelInfo.from_folder(model_dir, name="tiny")
    tokenizer = Tokenizer(model_dir)
    metrics = RouterMetrics(NodePool())
    service = RouterService(info, tokenizer, ScriptedBackend(TOKENS, finish="stop"), metrics)
    req = parse_completion({"model": "tiny", "prompt": "Hello", "max_tokens": 12}, info,
                           tokenizer)

    async def run():
        return [delta async for _, delta in service.run(req, "completions").events()]

    assert asyncio.run(run())
    got = samples(metrics)
    e2e = ("pdserve_router_e2e_request_latency_seconds_count",
           (("endpoint", "completions"),))
    assert got[e2e] == 1.0
    assert got[("pdserve_router_finished_requests_total", (("finish_reason", "stop"),))] == 1.0
