"""Scripted gRPC prefill/decode nodes and helpers for the router's PD-flow tests (the
boundary): a deterministic 'greedy model', fake nodes sharing one script, a cluster of
them behind a PdBackend over a memory registry."""

from __future__ import annotations

import asyncio

import grpc

from cluster.rpc_status import DECODE, PREFILL, RpcFailure
from engine.sampling_params import SamplingParams
from protos import common_pb2, node_pb2, node_pb2_grpc
from router.backend import NodeRequest
from router.metrics import RouterMetrics
from router.node_pool import NodePool, NodeState
from router.pd_backend import PdBackend
from router.policies import make_policy


def model_next(tokens: list[int]) -> int:
    """A deterministic 'greedy model': the next token depends on the whole sequence."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + 7) % 300 + 3


async def scripted_tokens(request, context, die_after: int | None = None,
                          hang_after: int | None = None,
                          die_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
    """The scripted model's tokens for `request` as DecodeEvents, one every 10 ms;
    `die_after=i` aborts with `die_code` before token i, `hang_after=i` goes silent."""
    tokens = list(request.prompt_token_ids)
    max_tokens = request.sampling.max_tokens
    for i in range(max_tokens):
        if die_after is not None and i == die_after:
            await context.abort(die_code, "node going away")
        if hang_after is not None and i == hang_after:
            await asyncio.sleep(3600)          # a hung process: alive, silent
        tokens.append(model_next(tokens))
        last = i == max_tokens - 1
        yield node_pb2.DecodeEvent(tokens=node_pb2.TokenEvent(
            token_ids=[tokens[-1]],
            finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0))
        await asyncio.sleep(0.01)


class Shared:
    def __init__(self):
        self.prefilled: dict[str, asyncio.Event] = {}
        self.prefill_requests: list = []
        self.reserve_requests: list = []
        self.cancelled: list[str] = []
        self.prefill_cancelled: list[str] = []     # Prefill calls cancelled by the router
        self.prefill_failed: set[str] = set()
        self.decodes: list[FakeDecode] = []
        # set: an early-first-token prefill holds its "push" (the decode stream's start)
        # until the test opens it
        self.push_gate: asyncio.Event | None = None

    def event(self, rid: str) -> asyncio.Event:
        return self.prefilled.setdefault(rid, asyncio.Event())


class FakeDecode(node_pb2_grpc.DecodeNodeServicer):
    def __init__(self, shared: Shared, die_after: int | None = None, full: bool = False,
                 hang_after: int | None = None, capacity: int | None = None,
                 refuse_push: bool = False,
                 die_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        """refuse_push: every push is refused as incomplete (as a decode node says it,
        naming the request and a block id that differs per attempt)."""
        self.shared, self.die_after, self.full = shared, die_after, full
        self.refuse_push = refuse_push
        self.die_code = die_code
        self.hang_after = hang_after
        self.capacity, self.active, self.admitted = capacity, 0, []
        self.draining = False
        shared.decodes.append(self)

    async def Decode(self, request, context):
        self.shared.reserve_requests.append((context, request))
        if self.draining:       # as a real decode node says it: healthy, go elsewhere
            await RpcFailure(grpc.StatusCode.UNAVAILABLE, "decode node is draining", DECODE,
                             replay=True).abort(context)
        if self.full or (self.capacity is not None and self.active >= self.capacity):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks")
        self.active += 1
        self.admitted.append(request.request_id)
        try:
            async for event in self._stream(request, context):
                yield event
        finally:
            self.active -= 1

    async def _stream(self, request, context):
        yield node_pb2.DecodeEvent(reservation=node_pb2.Reservation(
            reservation_id=f"res-{request.request_id}", block_ids=[5, 6, 7],
            num_cached_blocks=1, lease_ms=request.lease_ms,
            push_token=f"token-{request.request_id}".encode()))
        try:
            await self.shared.event(request.request_id).wait()
            if self.refuse_push:
                block = 5 + len(self.shared.reserve_requests)
                await RpcFailure(grpc.StatusCode.ABORTED, f"KV push refused: push for request "
                                 f"{request.request_id} is incomplete: missing layer 0 K "
                                 f"blocks [{block}]", DECODE).abort(context)
            if request.request_id in self.shared.prefill_failed:
                await RpcFailure(grpc.StatusCode.ABORTED, "prefill failed: see the prefill",
                                 PREFILL).abort(context)
            async for event in scripted_tokens(request, context, self.die_after,
                                               self.hang_after, self.die_code):
                yield event
        except asyncio.CancelledError:
            self.shared.cancelled.append(request.request_id)
            raise


class FakePrefill(node_pb2_grpc.PrefillNodeServicer):
    def __init__(self, shared: Shared, fail: bool = False, refuse: grpc.StatusCode | None = None,
                 hang: bool = False, reply_after: float = 0.0, early: bool = False,
                 early_token: int | None = None, early_late: bool = False):
        """reply_after: seconds between the push's end (the decode stream starts) and the
        Prefill reply (a loaded prefill node). early: stream the first token (the script's,
        or `early_token`) before the push, as a prefill node does; early_late: after the
        push instead, once the decode stream has had time to start (a FirstToken that
        lost the race)."""
        self.shared, self.fail, self.refuse, self.hang = shared, fail, refuse, hang
        self.reply_after = reply_after
        self.early, self.early_token = early or early_token is not None, early_token
        self.early_late = early_late

    async def Prefill(self, request, context):
        self.shared.prefill_requests.append(request)
        if self.hang:                   # a SIGSTOPped node: the call never ends
            await asyncio.sleep(3600)
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill node crashed")
        if self.refuse is not None:     # the decode stream learns first, then this reply
            self.shared.prefill_failed.add(request.request_id)
            self.shared.event(request.request_id).set()
            await asyncio.sleep(0.2)
            await context.abort(self.refuse, "prompt token 999 is outside the vocabulary")
        if self.early:
            token = self.early_token
            if token is None:
                token = model_next(list(request.prompt_token_ids))
            await context.write(node_pb2.PrefillEvent(
                first_token=node_pb2.FirstToken(token_id=token)))
            if self.shared.push_gate is not None:
                await self.shared.push_gate.wait()
        self.shared.event(request.request_id).set()
        if self.early_late:
            await asyncio.sleep(0.1)
            await context.write(node_pb2.PrefillEvent(first_token=node_pb2.FirstToken(
                token_id=model_next(list(request.prompt_token_ids)))))
        try:
            await asyncio.sleep(self.reply_after)
        except asyncio.CancelledError:
            self.shared.prefill_cancelled.append(request.request_id)
            raise
        await context.write(node_pb2.PrefillEvent(
            reply=node_pb2.PrefillReply(first_token_id=0, num_pushed_blocks=2)))


async def _serve(servicer, add) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _cluster(shared, decodes: list[dict], prefills: list[dict], policy="round-robin"):
    pool = NodePool()
    servers = []
    for i, kw in enumerate(prefills):
        s, addr = await _serve(FakePrefill(shared, **kw),
                               node_pb2_grpc.add_PrefillNodeServicer_to_server)
        servers.append(s)
        pool.upsert(NodeState(f"prefill-{i}", "prefill", addr, incarnation="x"))
    for i, kw in enumerate(decodes):
        s, addr = await _serve(FakeDecode(shared, **kw),
                               node_pb2_grpc.add_DecodeNodeServicer_to_server)
        servers.append(s)
        pool.upsert(NodeState(f"decode-{i}", "decode", addr, incarnation="x"))
    backend = PdBackend(pool, make_policy(policy), RouterMetrics(pool), max_model_len=512)
    _LIVE.extend(servers)
    return pool, backend, servers


async def _collect(backend, rid, prompt, max_tokens) -> tuple[list[int], list]:
    steps = []
    async for step in backend.generate(NodeRequest(rid, prompt,
                                                   SamplingParams(max_tokens=max_tokens))):
        steps.append(step)
    return [t for s in steps for t in s.token_ids], steps


def _expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(model_next(tokens))
    return tokens[len(prompt):]


# servers _cluster started, stopped by _run even when the test body fails: a gRPC server
# left running made pytest hang at exit (its final gc joined the server's poller thread)
_LIVE: list[grpc.aio.Server] = []


def _run(coro):
    async def guarded():
        try:
            return await asyncio.wait_for(coro, 30)
        finally:
            live, _LIVE[:] = list(_LIVE), []
            for server in live:
                await server.stop(None)
    return asyncio.run(guarded())


PROMPT = [11, 22, 33, 44, 55]
