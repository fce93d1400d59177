"""Drive one request through a prefill node and a decode node, as a router does.

Opens DecodeNode.Decode (reservation first), sends PrefillNode.Prefill at once with the
reservation, and collects the decode node's token events. Used by the integration tests
and bench/kv_transfer.py; the router has its own production version.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from cluster.kv_transfer.base import GRPC_OPTIONS
from cluster.proto_convert import FINISH_NAMES, sampling_to_proto
from engine.sampling_params import SamplingParams
from protos import node_pb2, node_pb2_grpc


@dataclass
class PdResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[node_pb2.TokenEvent] = field(default_factory=list)
    finish_reason: str | None = None
    reservation: node_pb2.Reservation | None = None
    prefill: node_pb2.PrefillReply | None = None
    ttft_s: float = 0.0          # request start -> first token event
    total_s: float = 0.0


class PdClient:
    def __init__(self, prefill_address: str, decode_address: str):
        self.prefill_address = prefill_address
        self.decode_address = decode_address
        self._pch = grpc.aio.insecure_channel(prefill_address, GRPC_OPTIONS)
        self._dch = grpc.aio.insecure_channel(decode_address, GRPC_OPTIONS)
        self.prefill = node_pb2_grpc.PrefillNodeStub(self._pch)
        self.decode = node_pb2_grpc.DecodeNodeStub(self._dch)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, timeout: float = 120.0) -> PdResult:
        t0 = time.perf_counter()
        out = PdResult()
        call = self.decode.Decode(node_pb2.ReserveRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids,
            sampling=sampling_to_proto(params)), timeout=timeout)
        prefill_task = None
        try:
            async for ev in call:
                if ev.HasField("reservation"):
                    res = out.reservation = ev.reservation
                    prefill_task = asyncio.ensure_future(self.prefill.Prefill(
                        node_pb2.PrefillRequest(
                            request_id=request_id, prompt_token_ids=prompt_token_ids,
                            sampling=sampling_to_proto(params),
                            decode_address=self.decode_address,
                            reservation_id=res.reservation_id, block_ids=res.block_ids,
                            num_cached_blocks=res.num_cached_blocks,
                            decode_fingerprint=res.fingerprint), timeout=timeout))
                    continue
                tokens = ev.tokens
                if not out.token_ids and tokens.token_ids:
                    out.ttft_s = time.perf_counter() - t0
                out.token_ids.extend(tokens.token_ids)
                out.text += tokens.text_delta
                if tokens.logprobs:
                    out.logprobs.append(tokens)
                if tokens.finish_reason:
                    out.finish_reason = FINISH_NAMES[tokens.finish_reason]
        finally:
            if prefill_task is not None:
                try:
                    out.prefill = await prefill_task
                except grpc.aio.AioRpcError:
                    if out.finish_reason is not None:
                        raise
        out.total_s = time.perf_counter() - t0
        return out

    async def close(self) -> None:
        await self._pch.close()
        await self._dch.close()
