"""The PD PUSH flow from the router's side, with replay on node failure.

Per attempt: pick a prefill and a decode node (the policy), open DecodeNode.Decode (its
first event is the reservation), send PrefillNode.Prefill the moment the reservation
arrives, and stream the decode node's token events back. The Prefill call is watched
alongside the token stream, so a prefill node that dies ends the attempt at once instead of
leaving the decode node to wait out its lease.

Which node failed, and whether it merely asks for a replay (draining, a reservation
released before its push began), is read from the structured trailers every node sends
(cluster/rpc_status.py), never from the text of a message. A replay hint excludes that
node for this request only. When a node fails (connection refused, UNAVAILABLE, a stream
that ends without a finish, no event for `stall_timeout_s`), the node is dropped from the
pool and the request is replayed on another pair with the
prompt plus every token already streamed as the new prompt and max_tokens reduced by them:
the client's stream continues where it was, with nothing lost or repeated. (Greedy output is
unchanged by a replay; penalties then count the streamed tokens as prompt tokens.)

Aggregated nodes (router/aggregated_flow.py) are units of their own: when some are
registered, each attempt goes to the less loaded of the best pair and the best aggregated
node, and an aggregated attempt fails, refuses and replays through this same loop.

A refusal that repeats on the next attempt with the same cause (`failure_cause`: the same
role, code and message, ids and numbers aside), and is not one that passes by itself (a
full node, a replay hint, a discovery view that lags), is not replayed again: the request ends at
once with a 500 naming the cause (RepeatedFailure), counted in
pdserve_router_repeated_failures_total and logged once. Such a refusal (a KV push the
decode node finds incomplete, say) is a bug in the cluster, and every replay would spend
the same prefill for the same refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from collections.abc import AsyncIterator

import grpc

from cluster import tracing
from cluster.proto_convert import finish_from_proto, logprobs_from_proto, sampling_to_proto
from cluster.tls import TlsConfig
from engine.sampling_params import SamplingParams
from protos import node_pb2, node_pb2_grpc
from router.admission import AdmissionQueue, Turn
from router.aggregated_flow import AGGREGATED, aggregated_attempt, pick_unit
from router.backend import NodeRequest, StepOutput
from router.errors import NodeFailure, NoNodeAvailable, Overloaded, RepeatedFailure
from router.metrics import PhaseClock, RouterMetrics
from router.node_calls import (  # noqa: F401 - ChannelCache: re-exported for callers
    ChannelCache,
    TryOther,
    classify_failure,
    stop_reason_from_wire,
    token_step,
)
from router.node_pool import NodePool, NodeState
from router.pd_calls import check_prefill, decode_result, prefill_reply
from router.policies.base import RoutingPolicy, RoutingRequest

log = logging.getLogger("pdserve.router")

# A request that finished while its Prefill reply was still on the way: the decode node
# admitted the push (its tokens came), so the reply follows within moments. Waited for
# this long rather than cancelled: a cancelled Prefill makes the prefill node count a
# failed push, abort the request there and notify the decode node, and drops its trace.
PREFILL_REPLY_GRACE_S = 5.0

class PdBackend:
    def __init__(self, pool: NodePool, policy: RoutingPolicy, metrics: RouterMetrics, *,
                 max_model_len: int, lease_ms: int = 30_000, max_attempts: int = 4,
                 stall_timeout_s: float = 60.0, queue_timeout_s: float = 30.0,
                 queue_depth: int = 1000, tls: TlsConfig | None = None):
        self.pool, self.policy, self.metrics = pool, policy, metrics
        self.max_model_len = max_model_len
        # A decode node that sends nothing for this long, while no prefill is pending for
        # it, is treated as down and the request replayed (a hung process would otherwise
        # hold the client forever; a slow one still sends every step). A pending prefill
        # is bounded by the reservation's lease instead, which the decode node enforces.
        self.stall_timeout_s = stall_timeout_s
        self.lease_ms = lease_ms
        # When every decode node is full, a request waits in a FIFO (router/admission.py)
        # up to this long, behind at most `queue_depth` others, before the client gets 429.
        self.queue_timeout_s = queue_timeout_s
        self.admission = AdmissionQueue(queue_depth)
        metrics.queued.set_function(lambda: self.admission.depth)
        self.max_attempts = max_attempts
        self.channels = ChannelCache(tls)

    def ready(self) -> bool:
        """Can serve now: a prefill + decode pair, or an aggregated node, is registered
        and not held as failed."""
        return bool(self.pool.nodes(AGGREGATED)) or (
            bool(self.pool.nodes("prefill")) and bool(self.pool.nodes("decode")))

    async def close(self) -> None:
        await self.channels.close()

    # ---- node failures ---------------------------------------------------------------
    async def _node_failed(self, node: NodeState, why: str, rid: str) -> None:
        log.warning("[%s] %s node %s (%s) failed: %s; dropping it", rid, node.role,
                    node.node_id, node.address, why)
        self.pool.mark_failed(node.node_id)
        self.metrics.node_failures.labels(node.role).inc()
        await self.channels.retire(node.address)

    # ---- the request -------------------------------------------------------------------
    async def generate(self, request: NodeRequest) -> AsyncIterator[StepOutput]:
        streamed: list[int] = []
        exclude: dict[str, set[str]] = {"prefill": set(), "decode": set(), AGGREGATED: set()}
        full: set[str] = set()           # nodes that said RESOURCE_EXHAUSTED
        refusals: list[str] = []
        attempt = 0                      # failures and refusals other than "full"
        last_cause: tuple | None = None  # failure_cause of the last refusal
        tries = 0                        # every call made (names the request on the nodes)
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        queued_until = arrived + self.queue_timeout_s
        turn: Turn | None = None         # this request's place while it waits for room
        waited = False
        waited_for_node = False

        def reserved() -> None:          # a decode node took it: the next waiter's turn
            nonlocal turn
            if turn is not None:
                turn.leave()
                turn = None
        try:
            while True:
                prompt = request.prompt_token_ids + streamed
                if len(prompt) >= self.max_model_len:     # only reachable after a replay
                    yield StepOutput([], finish_reason="length")
                    return
                params = request.params
                if streamed:
                    params = dataclasses.replace(params,
                                                 max_tokens=params.max_tokens - len(streamed))
                rid = request.request_id if tries == 0 else f"{request.request_id}.r{tries}"
                tries += 1
                routing = RoutingRequest(rid, prompt)
                if turn is None and self.admission.depth and not streamed:
                    turn = self.admission.join()     # others wait for room: behind them
                    waited = True
                if turn is not None:
                    await turn.wait(queued_until, self.queue_timeout_s)
                try:
                    # pre is None when the unit is an aggregated node (dec), which
                    # prefills itself (router/aggregated_flow.py)
                    pre, dec = pick_unit(self.pool, self.policy, routing, exclude)
                    if tries == 1:
                        self.metrics.phase.labels("queue").observe(loop.time() - arrived)
                except NoNodeAvailable as exc:
                    if full and loop.time() < queued_until:
                        # every node that could serve is full: wait for room in the queue
                        # (not a refusal), keeping this request's place once it has one
                        if turn is None:
                            turn = self.admission.join(front=waited)
                            waited = True
                        for ids in exclude.values():
                            ids -= full
                        full.clear()
                        continue
                    if full:
                        raise Overloaded(f"every node that could serve is full ({len(full)} "
                                         f"tried: {', '.join(sorted(full))}) for "
                                         f"{self.queue_timeout_s:g} s; retry later",
                                         retry_after_s=1) from None
                    if loop.time() < queued_until:
                        # no node of a role can take it now (restarting after a crash,
                        # draining, refused, not registered yet): wait for the pool to
                        # change rather than refuse (polled: a failed node's hold ends
                        # unannounced), then try every node again
                        waited_for_node = True
                        await self.pool.wait_change(min(1.0, queued_until - loop.time()))
                        for ids in exclude.values():
                            ids.clear()
                        continue
                    why = f"{exc.message} (waited {self.queue_timeout_s:g} s)" \
                        if waited_for_node else exc.message
                    if refusals:
                        raise NoNodeAvailable(f"{why}; last refusal: {refusals[-1]}"
                                              ) from None
                    raise NoNodeAvailable(why) from None
                if pre is None:
                    run = aggregated_attempt(self, dec, rid, prompt, params, request.params,
                                             first_attempt=not streamed, on_started=reserved)
                else:
                    run = self._attempt(pre, dec, rid, prompt, params, request.params,
                                        first_attempt=not streamed, on_reserved=reserved)
                failed = False
                try:
                    async with contextlib.aclosing(run) as steps:
                        async for step in steps:
                            streamed.extend(step.token_ids)
                            yield step
                            if step.finish_reason is not None:
                                return
                    raise NodeFailure(dec.node_id, "the token stream ended without a finish")
                except NodeFailure as f:
                    node = pre if pre is not None and f.node_id == pre.node_id else dec
                    await self._node_failed(node, str(f), rid)
                    last_cause = None        # a dead node is not the request's doing
                    failed = True
                    self.metrics.replays.inc()
                    self.metrics.attempt_failures.labels(node.role, "node_down").inc()
                except TryOther as t:
                    role = t.role
                    exclude[role].add(t.node_id)
                    self.metrics.attempt_failures.labels(role, t.code.name.lower()).inc()
                    refusals.append(f"{t.node_id}: {t.message}")
                    if t.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        log.info("[%s] %s node %s is full: %s; trying another", rid, role,
                                 t.node_id, t.message)
                        full.add(t.node_id)
                        continue             # bounded by the queue timeout, not by attempts
                    cause = None if t.may_pass else failure_cause(t, request.request_id)
                    if cause is not None and cause == last_cause:
                        self.metrics.repeated_failures.labels(role, t.code.name.lower()).inc()
                        log.error("[%s] failed the same way on two attempts, not replayed: "
                                  "%s node %s: %s: %s", request.request_id, role, t.node_id,
                                  t.code.name, t.message)
                        raise RepeatedFailure(
                            f"request failed the same way on {attempt + 1} attempts (not "
                            f"retried again): {role} node {t.node_id}: {t.code.name}: "
                            f"{t.message}") from None
                    last_cause = cause
                    log.info("[%s] %s node %s refused (%s): %s; trying another", rid, role,
                             t.node_id, t.code.name, t.message)
                attempt += 1
                if attempt >= self.max_attempts:
                    raise NoNodeAvailable(f"gave up after {attempt} attempts; last: "
                                          f"{refusals[-1] if refusals else 'node failure'}")
                if streamed:
                    log.info("[%s] replaying with %d streamed tokens on another unit", rid,
                             len(streamed))
                    if not failed:      # a node refusing mid-stream (one going away) too
                        self.metrics.replays.inc()
        finally:
            if turn is not None:
                turn.leave()

    async def _attempt(self, pre: NodeState, dec: NodeState, rid: str, prompt: list[int],
                       params: SamplingParams, original: SamplingParams, first_attempt: bool,
                       on_reserved=None) -> AsyncIterator[StepOutput]:
        decode_stub = node_pb2_grpc.DecodeNodeStub(self.channels.acquire(dec.address))
        prefill_stub = node_pb2_grpc.PrefillNodeStub(self.channels.acquire(pre.address))
        sampling = sampling_to_proto(params)
        call = decode_stub.Decode(node_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, lease_ms=self.lease_ms),
            metadata=tracing.outgoing())
        prefill: asyncio.Task | None = None
        prefill_call = None
        read: asyncio.Future | None = None
        # the prefill node's FirstToken, streamed ahead of its push's end; the decode
        # node's stream then repeats that token as its first, which is dropped
        early: asyncio.Future = asyncio.get_running_loop().create_future()
        repeated: int | None = None      # the early token, until the decode node repeats it
        # discovery dropping the prefill node (hung: its lease ran out; or drained) ends a
        # pending prefill at once, instead of after the decode node's reservation lease
        prefill_gone = asyncio.ensure_future(self.pool.removal(pre.node_id).wait())
        pre.inflight += 1
        dec.inflight += 1
        prefill_open = True
        prefill_cached = 0
        finished = False
        streamed_any = False             # a token of this attempt went to the client
        log.info("[%s] prefill %s -> decode %s (%d prompt tokens)", rid, pre.node_id,
                 dec.node_id, len(prompt))
        phases = PhaseClock(self.metrics.phase)
        try:
            read = asyncio.ensure_future(call.read())
            while True:
                pending_prefill = prefill is not None and prefill_open
                waits = {read, prefill, prefill_gone} if pending_prefill else {read}
                if pending_prefill and not early.done():
                    waits.add(early)
                done, _ = await asyncio.wait(
                    waits, timeout=None if pending_prefill else self.stall_timeout_s,
                    return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    raise NodeFailure(dec.node_id, f"no event for {self.stall_timeout_s:.0f} s")
                if pending_prefill and prefill_gone in done and prefill not in done:
                    raise NodeFailure(pre.node_id, "discovery dropped the node while its "
                                                   "prefill was pending")
                if prefill is not None and prefill_open and prefill in done:
                    prefill_open = False
                    pre.inflight -= 1
                    phases.end("prefill")
                    check_prefill(prefill, pre, dec)
                    prefill_cached = prefill.result().prefix_cached_tokens
                if early in done and not streamed_any:     # else it came too late
                    first = early.result()
                    repeated = first.token_id
                    streamed_any = True
                    phases.end("prefill")
                    phases.end("first_token")
                    yield StepOutput(
                        [first.token_id],
                        logprobs_from_proto([first.logprob])
                        if original.logprobs is not None else None,
                        meta={"prefill": pre.node_id, "decode": dec.node_id})
                if read not in done:
                    continue
                event = await decode_result(read, dec, prefill, pre)
                if event is grpc.aio.EOF:
                    raise NodeFailure(dec.node_id, "the token stream ended without a finish")
                read = asyncio.ensure_future(call.read())
                if event.HasField("reservation"):
                    r = event.reservation
                    phases.end("reserve")
                    if on_reserved is not None:
                        on_reserved()
                    prefill_call = prefill_stub.Prefill(node_pb2.PrefillRequest(
                        request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                        decode_address=dec.address, reservation_id=r.reservation_id,
                        block_ids=r.block_ids, num_cached_blocks=r.num_cached_blocks,
                        decode_fingerprint=r.fingerprint,
                        # the reservation's secret: to the chosen prefill node only
                        push_token=r.push_token,
                        # the granted lease (a node may cap the ask): keepalives fit in it
                        lease_ms=r.lease_ms), metadata=tracing.outgoing())
                    prefill = asyncio.ensure_future(prefill_reply(prefill_call, early))
                    continue
                t = event.tokens
                finish = finish_from_proto(t.finish_reason)
                if finish == "abort":
                    raise TryOther(dec, grpc.StatusCode.ABORTED,
                                    t.stop_reason or "the decode node aborted the request")
                phases.end("prefill")      # no-op once its reply came; else it ends here
                phases.end("first_token")
                cached = max(prefill_cached,
                             t.usage.cached_prompt_tokens if t.HasField("usage") else 0)
                finished = finish is not None
                skip = 0
                if repeated is not None and t.token_ids:
                    if t.token_ids[0] != repeated:
                        raise NodeFailure(dec.node_id, f"its first token {t.token_ids[0]} is "
                                          f"not the prefill node's {repeated}")
                    skip, repeated = 1, None
                streamed_any = True
                step = token_step(t, finish, params, original, cached, first_attempt,
                                  {"prefill": pre.node_id, "decode": dec.node_id}, skip)
                if step.token_ids or finished:
                    yield step
                if finished:
                    return
        finally:
            dec.inflight -= 1
            if prefill_open:
                pre.inflight -= 1
            try:
                if finished and prefill_open and not prefill.done():
                    await asyncio.wait({prefill}, timeout=PREFILL_REPLY_GRACE_S)
            finally:                         # even when this task is cancelled meanwhile
                for fut in (read, prefill, prefill_gone):
                    if fut is not None and not fut.done():
                        fut.cancel()
                call.cancel()
                if prefill_call is not None:
                    prefill_call.cancel()
                # Collect the cancelled calls' outcomes (a cancellation of this task itself
                # still propagates out of gather).
                await asyncio.gather(*(f for f in (read, prefill, prefill_gone)
                                       if f is not None), return_exceptions=True)
                await self.channels.release(dec.address)
                await self.channels.release(pre.address)
                self.admission.wake()        # this request's room is free again


def failure_cause(t: TryOther, request_id: str) -> tuple[str, str, str]:
    """What a refusal says is wrong, without what differs between attempts of the same
    request: its per-attempt id, reservation ids and every number (block ids, counts)."""
    text = re.sub(re.escape(request_id) + r"(?:\.r\d+)?", "<request>", t.message)
    return t.role, t.code.name, _VARYING.sub("#", text)


_VARYING = re.compile(r"\b[0-9a-f]*\d[0-9a-f]*\b")
