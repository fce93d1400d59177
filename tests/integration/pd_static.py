"""Drive requests through a prefill and a decode node the test started, with the router's
own PD flow (`router.static_pool.static_backend`: PdBackend over fixed addresses), and keep
each request's PrefillReply (pushed bytes and blocks) for the tests to check."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from engine.sampling_params import SamplingParams
from protos import node_pb2
from router.backend import NodeRequest
from router.static_pool import static_backend

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.max_send_message_length", 64 * 1024 * 1024)]


@dataclass
class PdResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    nodes: dict = field(default_factory=dict)     # which prefill / decode node served it
    prefill: node_pb2.PrefillReply | None = None  # the prefill node's reply to the router
    ttft_s: float = 0.0
    total_s: float = 0.0


class _PrefillReplies(grpc.aio.UnaryUnaryClientInterceptor):
    """Keeps every successful PrefillNode.Prefill reply by request id, without touching the
    call the backend awaits (read in a done callback)."""

    def __init__(self) -> None:
        self.replies: dict[str, node_pb2.PrefillReply] = {}
        self._pending: set[asyncio.Task] = set()

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        call = await continuation(client_call_details, request)
        method = client_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        if method.endswith("/Prefill"):
            call.add_done_callback(lambda c: self._keep(request.request_id, c))
        return call

    def _keep(self, request_id: str, call) -> None:
        async def read():
            try:
                self.replies[request_id] = await call
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
        task = asyncio.ensure_future(read())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def settle(self) -> None:
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


class _RecordingChannels:
    """PdBackend's channel cache (get / drop / close), with the recorder on every channel."""

    def __init__(self, recorder: _PrefillReplies) -> None:
        self.recorder = recorder
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(
                address, options=_CHANNEL_OPTIONS, interceptors=[self.recorder])
        return self._channels[address]

    async def drop(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close(grace=None)

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)


async def _one(backend, request: NodeRequest) -> PdResult:
    out = PdResult()
    t0 = time.perf_counter()
    async for step in backend.generate(request):
        if step.token_ids and not out.token_ids:
            out.ttft_s = time.perf_counter() - t0
        out.token_ids.extend(step.token_ids)
        out.logprobs.extend(step.logprobs or [])
        out.nodes = step.meta
        if step.finish_reason is not None:
            out.finish_reason = step.finish_reason
    out.total_s = time.perf_counter() - t0
    return out


async def generate_all(prefill_address: str, decode_address: str, prompts: list[list[int]],
                       params: SamplingParams, *, max_model_len: int,
                       prefix: str = "it") -> list[PdResult]:
    """Every prompt at once through the pair, as a router would run them."""
    backend = static_backend([prefill_address], [decode_address],
                             max_model_len=max_model_len, max_attempts=1)
    recorder = _PrefillReplies()
    backend.channels = _RecordingChannels(recorder)
    try:
        outs = await asyncio.gather(*[
            _one(backend, NodeRequest(f"{prefix}-{i}", list(p), params))
            for i, p in enumerate(prompts)])
        await recorder.settle()
    finally:
        await backend.close()
    for i, out in enumerate(outs):
        out.prefill = recorder.replies.get(f"{prefix}-{i}")
    return outs
