"""The router's aggregated flow over real gRPC against scripted nodes (the boundary): a
whole request in one self_prefill call, replay on another unit when an aggregated node dies
(before its first token, or mid-stream onto a PD pair) without loss or duplicates, the
choice of the less loaded unit, and readiness (a pair or an aggregated node)."""

from __future__ import annotations

import grpc
import pytest

from protos import node_pb2, node_pb2_grpc
from router.aggregated_flow import AGGREGATED, pick_unit
from router.errors import NoNodeAvailable
from router.metrics import RouterMetrics
from router.node_pool import NodePool, NodeState
from router.pd_backend import PdBackend
from router.policies import make_policy
from router.policies.base import RoutingRequest
from tests.router.pd_fakes import (
    PROMPT,
    FakeDecode,
    FakePrefill,
    Shared,
    _collect,
    _expected,
    _run,
    _serve,
    scripted_tokens,
)


class FakeAggregated(node_pb2_grpc.DecodeNodeServicer):
    """Prefills and decodes by itself with the scripted model; `die_after=i` ends the
    stream with UNAVAILABLE before token i (0: before the first token)."""

    def __init__(self, die_after: int | None = None):
        self.die_after = die_after
        self.requests: list[node_pb2.ReserveRequest] = []

    async def Decode(self, request, context):
        self.requests.append(request)
        if not request.self_prefill:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this is an aggregated node")
        async for event in scripted_tokens(request, context, self.die_after):
            yield event


async def _mixed(shared: Shared, aggregated: list[FakeAggregated], pairs: int = 0):
    """A pool of the given aggregated nodes and `pairs` healthy prefill + decode pairs."""
    pool, servers = NodePool(), []
    for i, fake in enumerate(aggregated):
        s, addr = await _serve(fake, node_pb2_grpc.add_DecodeNodeServicer_to_server)
        servers.append(s)
        pool.upsert(NodeState(f"aggregated-{i}", AGGREGATED, addr, incarnation="x"))
    for i in range(pairs):
        s, addr = await _serve(FakePrefill(shared),
                               node_pb2_grpc.add_PrefillNodeServicer_to_server)
        servers.append(s)
        pool.upsert(NodeState(f"prefill-{i}", "prefill", addr, incarnation="x"))
        s, addr = await _serve(FakeDecode(shared), node_pb2_grpc.add_DecodeNodeServicer_to_server)
        servers.append(s)
        pool.upsert(NodeState(f"decode-{i}", "decode", addr, incarnation="x"))
    backend = PdBackend(pool, make_policy("round-robin"), RouterMetrics(pool), max_model_len=512)
    return pool, backend, servers


async def _close(backend, servers) -> None:
    for s in servers:
        await s.stop(None)
    await backend.close()


def test_an_aggregated_node_serves_a_whole_request_in_one_self_prefill_call():
    async def main():
        shared, node = Shared(), FakeAggregated()
        pool, backend, servers = await _mixed(shared, [node])
        ready = backend.ready()
        tokens, steps = await _collect(backend, "a1", PROMPT, 6)
        await _close(backend, servers)
        return shared, node, pool, ready, tokens, steps

    shared, node, pool, ready, tokens, steps = _run(main())
    assert ready
    assert tokens == _expected(PROMPT, 6)
    assert steps[-1].finish_reason == "length"
    assert all(s.meta == {AGGREGATED: "aggregated-0"} for s in steps)
    (call,) = node.requests
    assert call.self_prefill and list(call.prompt_token_ids) == PROMPT
    assert call.request_id == "a1" and call.sampling.max_tokens == 6
    assert shared.prefill_requests == [] and shared.reserve_requests == []
    assert pool.get("aggregated-0").inflight == 0


def test_an_aggregated_node_dying_before_its_first_token_is_replayed_on_another_unit():
    async def main():
        shared = Shared()
        dying, healthy = FakeAggregated(die_after=0), FakeAggregated()
        pool, backend, servers = await _mixed(shared, [dying, healthy])
        tokens, _ = await _collect(backend, "a2", PROMPT, 5)
        live = [n.node_id for n in pool.nodes(AGGREGATED)]
        replays = backend.metrics.replays._value.get()
        await _close(backend, servers)
        return dying, healthy, tokens, live, replays

    dying, healthy, tokens, live, replays = _run(main())
    assert tokens == _expected(PROMPT, 5)
    assert live == ["aggregated-1"]                 # the dead node left routing at once
    assert replays == 1
    assert [r.request_id for r in dying.requests] == ["a2"]
    (replayed,) = healthy.requests
    assert replayed.request_id == "a2.r1" and list(replayed.prompt_token_ids) == PROMPT


def test_an_aggregated_node_dying_mid_stream_continues_on_a_pd_pair_without_loss():
    async def main():
        shared, dying = Shared(), FakeAggregated(die_after=3)
        pool, backend, servers = await _mixed(shared, [dying], pairs=1)
        tokens, steps = await _collect(backend, "a3", PROMPT, 8)
        await _close(backend, servers)
        return shared, tokens, steps

    shared, tokens, steps = _run(main())
    assert tokens == _expected(PROMPT, 8)           # identical to an uninterrupted run
    assert steps[0].meta == {AGGREGATED: "aggregated-0"}   # a tie goes to the aggregated
    assert steps[-1].meta == {"prefill": "prefill-0", "decode": "decode-0"}
    _, second = shared.reserve_requests[0]
    assert second.request_id == "a3.r1" and not second.self_prefill
    assert list(second.prompt_token_ids) == PROMPT + tokens[:3]
    assert second.sampling.max_tokens == 5


def _pool(aggregated_load: int | None, decode_load: int | None) -> NodePool:
    pool = NodePool()
    if aggregated_load is not None:
        pool.upsert(NodeState("aggregated-0", AGGREGATED, "a:1", incarnation="x",
                              running=aggregated_load))
    if decode_load is not None:
        pool.upsert(NodeState("prefill-0", "prefill", "p:1", incarnation="x"))
        pool.upsert(NodeState("decode-0", "decode", "d:1", incarnation="x",
                              running=decode_load))
    return pool


def _unit(pool: NodePool, excluded: str | None = None) -> str:
    exclude = {"prefill": set(), "decode": set(), AGGREGATED: {excluded} - {None}}
    pre, node = pick_unit(pool, make_policy("least-load"), RoutingRequest("r", PROMPT), exclude)
    return node.node_id if pre is None else f"{pre.node_id}+{node.node_id}"


def test_the_less_loaded_unit_is_chosen_and_a_tie_goes_to_the_aggregated_node():
    assert _unit(_pool(0, 0)) == "aggregated-0"
    assert _unit(_pool(2, 5)) == "aggregated-0"
    assert _unit(_pool(5, 2)) == "prefill-0+decode-0"
    assert _unit(_pool(0, 3), excluded="aggregated-0") == "prefill-0+decode-0"
    assert _unit(_pool(7, None)) == "aggregated-0"
    assert _unit(_pool(None, 7)) == "prefill-0+decode-0"
    with pytest.raises(NoNodeAvailable, match="no aggregated node and no prefill"):
        _unit(_pool(0, None), excluded="aggregated-0")
    with pytest.raises(NoNodeAvailable, match="no prefill node is available"):
        _unit(NodePool())


def test_ready_needs_a_prefill_and_decode_pair_or_an_aggregated_node():
    def ready(pool: NodePool) -> bool:
        return PdBackend(pool, make_policy("least-load"), RouterMetrics(pool),
                         max_model_len=512).ready()

    assert not ready(NodePool())
    half = NodePool()
    half.upsert(NodeState("decode-0", "decode", "d:1", incarnation="x"))
    assert not ready(half)                           # a decode node alone cannot serve
    assert ready(_pool(None, 0))
    assert ready(_pool(0, None))
    failed = _pool(0, None)
    failed.mark_failed("aggregated-0")               # held as failed: not serving
    assert not ready(failed)
