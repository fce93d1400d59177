"""DecodeNode gRPC service (grpc.aio): Decode (reserve + token stream), PushKv, abort.

It talks to the engine only through engine commands (KvReceiver submits ReserveForKv /
AdmitPrefilled / ReleaseRequest; a cancelled caller becomes an AbortRequest) and hears
back through the engine loop's outbox (decode_node/streams.py). Each reservation's fate
is the KvReceiver's state machine; `_on_release` turns a release into the status that
ends the request's stream, with the failing side and a replay hint in the trailers.

Only the Decode caller learns a reservation's push token (in the Reservation event); a
push or an AbortReservation without it is refused with PERMISSION_DENIED and changes
nothing. The lease a caller asks for is clamped to the node's maximum. At most
`max_grpc_pushes` PushKv streams run at once: a stream costs a handler task and buffers
before its header proves anything, so one more is answered RESOURCE_EXHAUSTED before a
byte of it is read (the raw-TCP data plane has its own cap, cluster/kv_transfer/limits.py).

An aggregated node (role "aggregated") is this service on a node that prefills by itself:
its Decode calls carry `self_prefill` and become a plain AddRequest on the engine (no
reservation, no push), streamed the same way (decode_node/self_prefill.py). The two roles
refuse each other's calls with FAILED_PRECONDITION, so a router that confused them learns
it at once and tries another unit.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import Future

import grpc

from cluster import tracing
from cluster.kv_transfer import local_socket
from cluster.kv_transfer.base import PushFailed
from cluster.kv_transfer.kv_receiver import (
    CapacityError,
    Draining,
    KvReceiver,
    PushDenied,
    ReleaseReason,
    Reservation,
    UnknownReservation,
)
from cluster.kv_transfer.receiver import PushHandler
from cluster.node_metrics import NodeMetrics
from cluster.proto_convert import fingerprint_from_proto, fingerprint_to_proto, sampling_from_proto
from cluster.request_timing import RequestTimer
from cluster.rpc_status import DECODE, PREFILL, RpcFailure
from decode_node.self_prefill import AGGREGATED, stream_self_prefill
from decode_node.streams import StreamTable, relay
from engine.commands import AbortRequest
from engine.pd_fingerprint import Fingerprint
from protos import node_pb2, node_pb2_grpc

log = logging.getLogger("decode_node")

LEASE_CHECK_S = 0.2
DRAINING = "decode node is draining"
# Pushes of one node are at most its reservations, at most max_num_seqs: the default cap
# leaves room for as many again (a push whose stream is still closing, a fallback from the
# data plane) and never goes below MIN_GRPC_PUSHES for small test engines.
MIN_GRPC_PUSHES = 64


def default_max_grpc_pushes(max_num_seqs: int) -> int:
    return max(MIN_GRPC_PUSHES, 2 * max_num_seqs)

# How a released reservation ends its stream (None: the caller is gone, nobody to tell).
_RELEASE_STATUS = {
    ReleaseReason.CALLER_CANCELLED: None,
    ReleaseReason.PREFILL_FAILED: (grpc.StatusCode.ABORTED, PREFILL, False),
    ReleaseReason.PUSH_REFUSED: (grpc.StatusCode.ABORTED, DECODE, False),
    ReleaseReason.LEASE_EXPIRED: (grpc.StatusCode.ABORTED, DECODE, True),
    ReleaseReason.DRAINING: (grpc.StatusCode.UNAVAILABLE, DECODE, True),
}


class DecodeService(node_pb2_grpc.DecodeNodeServicer):
    def __init__(self, engine, receiver: KvReceiver, streams: StreamTable,
                 fingerprint: Fingerprint, node_id: str = "decode", model_id: str = "",
                 max_grpc_pushes: int = MIN_GRPC_PUSHES, role: str = "decode",
                 metrics: NodeMetrics | None = None):
        """metrics: the node's per-request metrics (None: not observed)."""
        if role not in ("decode", AGGREGATED):
            raise ValueError(f"role must be 'decode' or {AGGREGATED!r}, got {role!r}")
        if max_grpc_pushes < 1:
            raise ValueError(f"max_grpc_pushes must be >= 1, got {max_grpc_pushes}")
        self.engine = engine
        self.receiver = receiver
        self.streams = streams
        self.fingerprint = fingerprint
        self.node_id = node_id
        self.model_id = model_id
        self.role = role
        self.metrics = metrics
        self.kv_tcp_address = ""          # the raw-TCP KV data plane, when it runs
        self.kv_local_socket = ""         # ... and its Unix socket for this host's nodes
        self.push_handler = PushHandler(receiver, fingerprint)
        receiver.on_release = self._on_release
        self.max_grpc_pushes = max_grpc_pushes
        self.grpc_pushes = 0                # PushKv streams being handled now
        self.grpc_pushes_refused = 0        # answered RESOURCE_EXHAUSTED for the cap
        self._reaper: asyncio.Task | None = None

    @property
    def draining(self) -> bool:
        return self.receiver.refusing is not None

    @property
    def in_flight(self) -> int:
        return len(self.streams.streams)

    def start(self) -> None:
        self.streams.bind(asyncio.get_running_loop())
        self._reaper = asyncio.create_task(self._reap_leases(), name="lease-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)

    def begin_drain(self) -> int:
        """SIGTERM: refuse new reservations and release those whose push has not begun
        (their callers replay elsewhere); admitted requests run to their end. Returns how
        many reservations were released."""
        released = self.receiver.drain(DRAINING)
        log.info("drain: refusing new reservations; released %d not yet pushed",
                 len(released))
        return len(released)

    # ---- Decode: reserve, then stream tokens ---------------------------------------
    async def Decode(self, request: node_pb2.ReserveRequest, context):
        if self.draining:
            await RpcFailure(grpc.StatusCode.UNAVAILABLE, DRAINING, DECODE, True).abort(context)
        rid = request.request_id or uuid.uuid4().hex
        timer = RequestTimer(self.metrics, f"{self.role}_node.Decode", tracing.incoming(context),
                             rid)
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt_token_ids is empty: at least one token is required")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {exc}")
        if request.self_prefill != (self.role == AGGREGATED):
            await RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, _role_refusal(self.role),
                             DECODE).abort(context)
        if request.self_prefill:
            async for event in stream_self_prefill(self.engine, self.streams, rid,
                                                   list(request.prompt_token_ids), params,
                                                   context, timer):
                yield event
            return
        if request.HasField("prefill_fingerprint"):
            diff = self.fingerprint.mismatches(fingerprint_from_proto(request.prefill_fingerprint))
            if diff:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "KV fingerprint mismatch (decode node vs prefill node): "
                                    + "; ".join(diff))
        stream = self.streams.open(rid)
        if stream is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request id {rid!r} is already in use")
        finished = False
        reserving: Future | None = None
        try:
            lease_s = request.lease_ms / 1000 if request.lease_ms else None
            try:
                reserving = self.receiver.reserve(rid, list(request.prompt_token_ids), params,
                                                  lease_s)
                res: Reservation = await asyncio.wrap_future(reserving)
            except Draining as exc:
                finished = True
                await RpcFailure(grpc.StatusCode.UNAVAILABLE, str(exc), DECODE, True
                                 ).abort(context)
            except CapacityError as exc:
                finished = True
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except ValueError as exc:
                finished = True
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            stream.reservation_id = res.reservation_id
            yield node_pb2.DecodeEvent(reservation=node_pb2.Reservation(
                reservation_id=res.reservation_id, block_ids=res.block_ids,
                num_cached_blocks=res.num_cached_blocks,
                lease_ms=int(round(res.lease_s * 1000)),     # granted, after the cap
                fingerprint=fingerprint_to_proto(self.fingerprint),
                push_token=res.token))
            # a failure relayed here comes after the reservation was already released
            async for event in relay(stream, context, timer, self_prefilled=False):
                yield event
        finally:
            self.streams.close(rid)
            if not (finished or stream.relayed_end):   # the caller went away (or we
                self._cancel(rid, reserving)            # failed): free it

    def _cancel(self, request_id: str, reserving: Future | None) -> None:
        def release(fut: Future) -> None:
            if fut.cancelled() or fut.exception() is not None:
                return
            res = fut.result()
            if self.receiver.release(res.reservation_id, ReleaseReason.CALLER_CANCELLED):
                return
            self.engine.submit(AbortRequest(request_id))     # admitted: abort it
            log.info("request %s: aborted (caller cancelled)", request_id)

        if reserving is not None:     # still reserving: release once the blocks are found
            reserving.add_done_callback(release)

    # ---- PushKv --------------------------------------------------------------------
    async def PushKv(self, request_iterator, context):
        # counted on the event loop (every handler runs on it): no lock needed
        if self.grpc_pushes >= self.max_grpc_pushes:
            self.grpc_pushes_refused += 1
            await RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"too many KV pushes in progress on this decode node "
                             f"({self.max_grpc_pushes}, --max-grpc-pushes)", DECODE
                             ).abort(context)
        self.grpc_pushes += 1
        try:
            return await self.push_handler.handle(request_iterator.__aiter__())
        except PushFailed as exc:
            await RpcFailure(exc.code, exc.message, exc.side).abort(context)
        finally:
            self.grpc_pushes -= 1

    # ---- failure notices and leases ------------------------------------------------
    def _on_release(self, res: Reservation) -> None:
        """Any thread: a reservation was released; end its stream with the reason."""
        status = _RELEASE_STATUS[res.release_reason]
        if status is None:
            return
        code, side, replay = status
        what = {ReleaseReason.PREFILL_FAILED: "prefill failed",
                ReleaseReason.PUSH_REFUSED: "KV push refused",
                ReleaseReason.LEASE_EXPIRED: "reservation lease expired before the KV "
                                             "push completed",
                ReleaseReason.DRAINING: "reservation released: decode node is draining",
                }[res.release_reason]
        self.streams.fail(res.request_id, RpcFailure(code, f"{what}: {res.detail}", side,
                                                     replay))

    async def AbortReservation(self, request: node_pb2.AbortRequest, context):
        """Only the holder of the reservation's token, naming its own request, may end
        it; anyone else gets PERMISSION_DENIED and the reservation goes on."""
        try:
            self.receiver.authorize(request.reservation_id, request.push_token,
                                    request.request_id)
        except UnknownReservation:
            return node_pb2.AbortReply(found=False)
        except PushDenied as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        res = self.receiver.release(request.reservation_id, ReleaseReason.PREFILL_FAILED,
                                    request.reason or "no reason given")
        return node_pb2.AbortReply(found=res is not None)

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            for res in self.receiver.expire():
                log.warning("request %s: lease expired before its KV push completed; its "
                            "blocks returned to the pool", res.request_id)

    async def GetNodeInfo(self, request, context):
        return node_pb2.NodeInfo(node_id=self.node_id, role=self.role, model_id=self.model_id,
                                 max_model_len=self.engine.max_model_len,
                                 fingerprint=fingerprint_to_proto(self.fingerprint),
                                 kv_tcp_address=self.kv_tcp_address,
                                 kv_local_socket=self.kv_local_socket,
                                 host_id=local_socket.host_id() if self.kv_local_socket else "")


def _role_refusal(role: str) -> str:
    if role == AGGREGATED:
        return ("this is an aggregated node: it prefills requests itself (self_prefill) and "
                "takes no reservation or KV push; pair prefill nodes with a decode node")
    return ("self_prefill refused: this is a decode-only node, it decodes only KV pushed by "
            "a prefill node into a reservation; send self_prefill to an aggregated node "
            "(`pdserve aggregated`)")
