"""Aggregated mode from the router's side: the unit choice and one attempt on an
aggregated node.

A serving unit is either a prefill + decode pair or one aggregated node (a node that
prefills and decodes by itself, `pdserve aggregated`). `pick_unit` lets the policy choose
the best node of each kind, then takes the less loaded unit: the aggregated node's load
against the pair's decode node's (the decode node holds a PD request for its whole life;
the prefill node only briefly). A tie goes to the aggregated node, one hop fewer.

`aggregated_attempt` is the whole request in one call: DecodeNode.Decode with
`self_prefill`, no reservation, no Prefill call, then the same TokenEvents a decode node
streams. Its failures are read like a decode node's (router/node_calls.py), so PdBackend's
loop replays it on another unit exactly as it replays a pair: a node that dies (before or
after its first token) is dropped and the request continues elsewhere with the tokens
already streamed as prompt. A node with nothing to send for `stall_timeout_s` counts as
down; unlike a pair there is no separate prefill to wait for, so the bound holds from the
first event on (a queue longer than that on one node is replayed elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from cluster import tracing
from cluster.proto_convert import finish_from_proto, sampling_to_proto
from cluster.rpc_status import DECODE, failure_of
from engine.sampling_params import SamplingParams
from protos import node_pb2, node_pb2_grpc
from router.backend import StepOutput
from router.errors import NodeFailure, NoNodeAvailable
from router.metrics import PhaseClock
from router.node_calls import TryOther, classify_failure, token_step
from router.node_pool import NodePool, NodeState
from router.policies.base import RoutingPolicy, RoutingRequest

log = logging.getLogger("pdserve.router")

AGGREGATED = "aggregated"


def pick_unit(pool: NodePool, policy: RoutingPolicy, routing: RoutingRequest,
              exclude: dict[str, set[str]]) -> tuple[NodeState | None, NodeState]:
    """(prefill, decode) for a PD pair, or (None, node) for an aggregated node; nodes in
    `exclude[role]` are not considered. NoNodeAvailable names what is missing."""
    def live(role: str) -> list[NodeState]:
        return [n for n in pool.nodes(role) if n.node_id not in exclude.get(role, ())]

    aggregated, prefill, decode = live(AGGREGATED), live("prefill"), live("decode")
    single = policy.pick(AGGREGATED, aggregated, routing) if aggregated else None
    if not (prefill and decode):
        if single is not None:
            return None, single
        if pool.nodes(AGGREGATED):
            raise NoNodeAvailable("no aggregated node and no prefill + decode pair is "
                                  "available")
        # a PD-only cluster: name the missing role, as before aggregated nodes existed
        raise NoNodeAvailable(f"no {'prefill' if not prefill else 'decode'} node is "
                              f"available")
    pair = policy.pick("prefill", prefill, routing), policy.pick("decode", decode, routing)
    if single is not None and single.load <= pair[1].load:
        return None, single
    return pair


async def aggregated_attempt(backend, node: NodeState, rid: str, prompt: list[int],
                             params: SamplingParams, original: SamplingParams,
                             first_attempt: bool, on_started=None
                             ) -> AsyncIterator[StepOutput]:
    """One try of a request on an aggregated node. `backend` is the PdBackend running the
    request (its channels, stall bound and admission queue). on_started: the node took
    the request (it queues it itself), so a waiter's turn in the admission queue ends."""
    stub = node_pb2_grpc.DecodeNodeStub(backend.channels.acquire(node.address))
    call = stub.Decode(node_pb2.ReserveRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
        self_prefill=True), metadata=tracing.outgoing())
    node.inflight += 1
    phases = PhaseClock(backend.metrics.phase)
    read: asyncio.Future | None = None
    log.info("[%s] aggregated %s (%d prompt tokens)", rid, node.node_id, len(prompt))
    if on_started is not None:
        on_started()
    try:
        while True:
            read = asyncio.ensure_future(call.read())
            done, _ = await asyncio.wait({read}, timeout=backend.stall_timeout_s)
            if not done:
                raise NodeFailure(node.node_id,
                                  f"no event for {backend.stall_timeout_s:.0f} s")
            try:
                event = read.result()
            except grpc.aio.AioRpcError as exc:
                raise classify_failure(failure_of(exc, DECODE), node) from None
            if event is grpc.aio.EOF:
                raise NodeFailure(node.node_id, "the token stream ended without a finish")
            if not event.HasField("tokens"):
                # a reservation: the node is not aggregated (a role mix-up); try another
                raise TryOther(node, grpc.StatusCode.FAILED_PRECONDITION,
                               "the node answered self_prefill with a reservation")
            t = event.tokens
            finish = finish_from_proto(t.finish_reason)
            if finish == "abort":
                raise TryOther(node, grpc.StatusCode.ABORTED,
                               t.stop_reason or "the aggregated node aborted the request")
            phases.end(AGGREGATED)
            cached = t.usage.cached_prompt_tokens if t.HasField("usage") else 0
            yield token_step(t, finish, params, original, cached, first_attempt,
                             {AGGREGATED: node.node_id})
            if finish is not None:
                return
    finally:
        node.inflight -= 1
        if read is not None and not read.done():
            read.cancel()
        call.cancel()
        if read is not None:
            await asyncio.gather(read, return_exceptions=True)
        await backend.channels.release(node.address)
        backend.admission.wake()            # this request's room is free again
