"""DecodeNode gRPC service (grpc.aio): Decode (reserve + token stream), PushKv, abort."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from cluster.kv_transfer.base import PushFailed
from cluster.kv_transfer.receiver import PushHandler
from cluster.proto_convert import fingerprint_from_proto, fingerprint_to_proto, sampling_from_proto
from decode_node.streams import RequestStream, StreamTable
from engine.pd_decode import CapacityError, KvReceiver
from engine.pd_fingerprint import Fingerprint
from engine.sequence import Sequence
from protos import node_pb2, node_pb2_grpc

log = logging.getLogger("decode_node")

LEASE_CHECK_S = 0.2


class DecodeService(node_pb2_grpc.DecodeNodeServicer):
    def __init__(self, engine, receiver: KvReceiver, streams: StreamTable,
                 fingerprint: Fingerprint, wake, node_id: str = "decode",
                 model_id: str = ""):
        self.engine = engine
        self.receiver = receiver
        self.streams = streams
        self.fingerprint = fingerprint
        self.wake = wake                  # wakes the engine loop
        self.node_id = node_id
        self.model_id = model_id
        self.draining = False
        self.kv_tcp_address = ""          # the raw-TCP KV data plane, when it runs
        self.push_handler = PushHandler(receiver, fingerprint, self._admitted, self._push_failed)
        self._reaper: asyncio.Task | None = None

    @property
    def lock(self):
        return self.receiver.lock

    @property
    def in_flight(self) -> int:
        return len(self.streams.streams)

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_leases(), name="lease-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)

    # ---- Decode: reserve, then stream tokens ---------------------------------------
    async def Decode(self, request: node_pb2.ReserveRequest, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode node is draining")
        rid = request.request_id or uuid.uuid4().hex
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt_token_ids is empty: at least one token is required")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {exc}")
        if request.HasField("prefill_fingerprint"):
            diff = self.fingerprint.mismatches(fingerprint_from_proto(request.prefill_fingerprint))
            if diff:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "KV fingerprint mismatch (decode node vs prefill node): "
                                    + "; ".join(diff))
        if rid in self.streams.streams:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request id {rid!r} is already in use")
        stream = RequestStream(rid, asyncio.get_running_loop())
        self.streams.streams[rid] = stream
        finished = False
        try:
            lease_s = request.lease_ms / 1000 if request.lease_ms else None
            try:
                res = await asyncio.to_thread(self.receiver.reserve, rid,
                                              list(request.prompt_token_ids), params, lease_s)
            except CapacityError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            stream.reservation_id = res.reservation_id
            lease_ms = int(round((lease_s or self.receiver.default_lease_s) * 1000))
            yield node_pb2.DecodeEvent(reservation=node_pb2.Reservation(
                reservation_id=res.reservation_id, block_ids=res.block_ids,
                num_cached_blocks=res.num_cached_blocks, lease_ms=lease_ms,
                fingerprint=fingerprint_to_proto(self.fingerprint)))
            while True:
                item = await stream.queue.get()
                if isinstance(item, PushFailed):
                    finished = True      # the reservation is already released
                    await context.abort(item.code, item.message)
                yield node_pb2.DecodeEvent(tokens=item)
                if item.finish_reason:
                    finished = True
                    return
        finally:
            self.streams.streams.pop(rid, None)
            if not finished:             # the caller went away (or we failed): free it
                await asyncio.to_thread(self._abort_request, rid, stream.reservation_id)

    def _abort_request(self, request_id: str, reservation_id: str) -> None:
        with self.lock:
            if reservation_id and self.receiver.release(reservation_id, "caller cancelled"):
                return
            seq = self.engine.requests.get(request_id)
            if seq is not None:
                self.engine.abort(request_id)
                self.streams.output_processor.forget(seq)
                log.info("request %s: aborted (caller cancelled)", request_id)

    # ---- PushKv --------------------------------------------------------------------
    async def PushKv(self, request_iterator, context):
        try:
            return await self.push_handler.handle(request_iterator.__aiter__())
        except PushFailed as exc:
            await context.abort(exc.code, exc.message)

    async def _admitted(self, seq: Sequence) -> None:
        def emit():
            with self.lock:
                self.streams.emit(seq)
        await asyncio.to_thread(emit)
        self.wake()

    async def _push_failed(self, request_id: str, reservation_id: str, err: PushFailed) -> None:
        self.streams.fail(request_id, PushFailed(grpc.StatusCode.ABORTED,
                                                 f"KV push refused: {err}"))

    # ---- failure notices and leases ------------------------------------------------
    async def AbortReservation(self, request: node_pb2.AbortRequest, context):
        res = await asyncio.to_thread(self.receiver.release, request.reservation_id,
                                      f"abort notice: {request.reason}")
        if res is not None:
            self.streams.fail(res.request_id, PushFailed(
                grpc.StatusCode.ABORTED, f"prefill failed: {request.reason or 'no reason given'}"))
        return node_pb2.AbortReply(found=res is not None)

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            for res in await asyncio.to_thread(self.receiver.expire):
                log.warning("request %s: lease expired before its KV push completed; its "
                            "blocks returned to the pool", res.request_id)
                self.streams.fail(res.request_id, PushFailed(
                    grpc.StatusCode.ABORTED, "reservation lease expired before the KV push "
                    "completed"))

    async def GetNodeInfo(self, request, context):
        return node_pb2.NodeInfo(node_id=self.node_id, role="decode", model_id=self.model_id,
                                 max_model_len=self.engine.max_model_len,
                                 fingerprint=fingerprint_to_proto(self.fingerprint),
                                 kv_tcp_address=self.kv_tcp_address)
