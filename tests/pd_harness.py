"""In-process PD pair for unit tests: a prefill node and a decode node wired by the fake
in-process transport, their gRPC service methods called directly with a stand-in for the
grpc.aio servicer context (the only thing replaced: the gRPC runtime itself)."""

from __future__ import annotations

import asyncio

import grpc

from cluster.kv_transfer.inproc import InProcessTransport
from cluster.proto_convert import FINISH_NAMES, logprobs_from_proto, sampling_to_proto
from decode_node.node import DecodeNode
from engine.config import EngineConfig
from prefill_node.decode_gate import StaticDecodeGate
from prefill_node.node import PrefillNode
from protos import node_pb2

DECODE_ADDRESS = "decode-0"


class RpcError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, metadata=()):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details
        self.metadata = dict(metadata)      # the structured trailers (cluster/rpc_status.py)


class FakeContext:
    """What the services use of grpc.aio.ServicerContext: abort()."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        raise RpcError(code, details, trailing_metadata)


class PdPair:
    def __init__(self, folder, prefill_opts: dict, decode_opts: dict, lease_s: float = 30.0,
                 tcp: bool = False, decode_options: dict | None = None, kv_push: str = "auto"):
        """tcp=True: KV goes over the raw-TCP data plane (real loopback sockets) instead of
        the in-process fake; abort notices (and the push when the data plane turns it
        away) still go through the fake. The prefill node may push to DECODE_ADDRESS only.
        decode_options: more DecodeNode arguments (max_lease_s, kv_tcp_limits). kv_push:
        the prefill node's (`layer`, `step`; auto is `step` on a CPU)."""
        self.transport = InProcessTransport()
        self.tcp = tcp
        self.token_events: dict[str, list[list[int]]] = {}   # rid -> each event's tokens
        # rid -> the FirstToken the prefill node streamed ahead of its push's end
        self.first_tokens: dict[str, node_pb2.FirstToken] = {}
        push_transport = self.transport
        if tcp:
            from cluster.kv_transfer.tcp_transport import TcpTransport
            push_transport = TcpTransport(self.transport)
        self.prefill = PrefillNode(EngineConfig(model=str(folder), **prefill_opts),
                                   push_transport, chunk_bytes=1024,
                                   decode_gate=StaticDecodeGate([DECODE_ADDRESS]),
                                   kv_push=kv_push)
        self.decode = DecodeNode(EngineConfig(model=str(folder), **decode_opts), lease_s=lease_s,
                                 kv_tcp_listen="127.0.0.1:0" if tcp else None,
                                 **(decode_options or {}))
        svc = self.decode.service
        self.transport.attach(DECODE_ADDRESS, svc.push_handler,
                              on_abort=lambda req: svc.AbortReservation(req, FakeContext()))

    def start(self) -> None:
        self.prefill.start()
        self.decode.start()
        if self.tcp:
            # (TCP address, Unix socket): TCP here, the socket has tests of its own
            self.prefill.transport._data_address[DECODE_ADDRESS] = \
                (self.decode.service.kv_tcp_address, "")

    async def stop(self) -> None:
        await self.prefill.stop()
        await self.decode.stop()

    def free_blocks(self) -> tuple[int, int]:
        return (self.prefill.engine.load().free_blocks,
                self.decode.engine.load().free_blocks)

    async def generate(self, rid: str, prompt: list[int], params, lease_ms: int = 0,
                       prefill_tamper=None, before_prefill=None):
        """Decode stream + prefill, as a router does. Returns (tokens, logprob entries,
        finish reason); raises RpcError from either side. before_prefill: an async
        callable given the Reservation, awaited before the Prefill call (an attacker's
        moment)."""
        stream = self.decode.service.Decode(node_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
            lease_ms=lease_ms), FakeContext())
        first = await anext(stream)
        res = first.reservation
        if before_prefill is not None:
            await before_prefill(res)
        req = node_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
            decode_address=DECODE_ADDRESS, reservation_id=res.reservation_id,
            block_ids=res.block_ids, num_cached_blocks=res.num_cached_blocks,
            decode_fingerprint=res.fingerprint, push_token=res.push_token)
        if prefill_tamper is not None:
            prefill_tamper(req)
        async def early(event: node_pb2.PrefillEvent) -> None:
            self.first_tokens[rid] = event.first_token
        prefill = asyncio.ensure_future(self.prefill.service.prefill(req, FakeContext(),
                                                                     early=early))
        tokens, logprobs, finish = [], [], None

        async def read() -> None:
            nonlocal finish
            async for ev in stream:
                self.token_events.setdefault(rid, []).append(list(ev.tokens.token_ids))
                tokens.extend(ev.tokens.token_ids)
                logprobs.extend(logprobs_from_proto(ev.tokens.logprobs))
                if ev.tokens.finish_reason:
                    finish = FINISH_NAMES[ev.tokens.finish_reason]
        reader = asyncio.ensure_future(read())
        await asyncio.wait({reader, prefill}, return_when=asyncio.FIRST_EXCEPTION)
        if prefill.done() and prefill.exception() is not None and not reader.done():
            reader.cancel()         # as a router does: a failed prefill ends the attempt
        stream_out, prefill_out = await asyncio.gather(reader, prefill, return_exceptions=True)
        for out in (prefill_out, stream_out):
            if isinstance(out, BaseException) and not isinstance(
                    out, (RpcError, asyncio.CancelledError)):
                raise out
        # the prefill's error is the cause; the decode stream's ABORTED its consequence
        for out in (prefill_out, stream_out):
            if isinstance(out, RpcError):
                raise out
        return tokens, logprobs, finish
