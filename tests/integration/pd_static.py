"""Drive requests through a prefill and a decode node the test started, with the router's
own PD flow (`router.static_pool.static_backend`: PdBackend over fixed addresses), and keep
each request's PrefillReply (pushed bytes and blocks) for the tests to check."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams
from protos import node_pb2
from router.backend import NodeRequest
from router.pd_backend import ChannelCache
from router.static_pool import static_backend


@dataclass
class PdResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    nodes: dict = field(default_factory=dict)     # which prefill / decode node served it
    prefill: node_pb2.PrefillReply | None = None  # the prefill node's reply to the router
    first_token: node_pb2.FirstToken | None = None  # its first token, streamed ahead
    ttft_s: float = 0.0
    total_s: float = 0.0


class _PrefillReplies:
    """Keeps every PrefillNode.Prefill reply and early first token by request id, as the
    backend reads the stream."""

    def __init__(self) -> None:
        self.replies: dict[str, node_pb2.PrefillReply] = {}
        self.first_tokens: dict[str, node_pb2.FirstToken] = {}

    def keep(self, request_id: str, event: node_pb2.PrefillEvent) -> None:
        if event.HasField("reply"):
            self.replies[request_id] = event.reply
        elif event.HasField("first_token"):
            self.first_tokens[request_id] = event.first_token


class _RecordedCall:
    """A Prefill stream as the backend reads it (async iteration, cancel), its reply kept."""

    def __init__(self, call, request_id: str, recorder: _PrefillReplies) -> None:
        self.call, self.request_id, self.recorder = call, request_id, recorder

    async def __aiter__(self):
        async for event in self.call:
            self.recorder.keep(self.request_id, event)
            yield event

    def cancel(self) -> bool:
        return self.call.cancel()


class _Prefill:
    """A unary-stream multicallable whose calls the recorder watches."""

    def __init__(self, inner, recorder: _PrefillReplies) -> None:
        self.inner, self.recorder = inner, recorder

    def __call__(self, request, *args, **kwargs):
        return _RecordedCall(self.inner(request, *args, **kwargs), request.request_id,
                             self.recorder)


class _Channel:
    """A grpc.aio channel whose PrefillNode.Prefill calls are recorded; all else as is."""

    def __init__(self, inner: grpc.aio.Channel, recorder: _PrefillReplies) -> None:
        self._inner, self._recorder = inner, recorder

    def unary_stream(self, method, *args, **kwargs):
        mc = self._inner.unary_stream(method, *args, **kwargs)
        name = method.decode() if isinstance(method, bytes) else method
        return _Prefill(mc, self._recorder) if name.endswith("/Prefill") else mc

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _RecordingChannels(ChannelCache):
    """The backend's own channel cache; every channel it hands out records Prefill replies."""

    def __init__(self, recorder: _PrefillReplies) -> None:
        super().__init__()
        self.recorder = recorder

    def get(self, address: str):
        return _Channel(super().get(address), self.recorder)


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
    finally:
        await backend.close()
    for i, out in enumerate(outs):
        out.prefill = recorder.replies.get(f"{prefix}-{i}")
        out.first_token = recorder.first_tokens.get(f"{prefix}-{i}")
    return outs
