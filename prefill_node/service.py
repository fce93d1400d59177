"""PrefillNode gRPC service (grpc.aio): Prefill with the layer-wise KV push, abort.

Prefill streams the prompt's first token the moment it is sampled, then the reply once the
push is acknowledged: the router shows that token to its client while the KV still
travels (on one box, 150-300 ms for a burst's step), instead of after the push and the
decode node's next step.

The engine is reached only by commands (an AddRequest carrying the push target, an
AbortRequest); failures carry their side in the trailers (cluster/rpc_status.py): a
refusal by the decode node says `decode`, this node's own failure says `prefill`.

The decode address a caller names must pass the node's DecodeGate (registered decode
nodes) before anything is dialed, abort notices included: PERMISSION_DENIED otherwise. The
reservation's push token from the request goes into the push header and every abort
notice; it is never logged."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

import grpc

from cluster import tracing
from cluster.kv_transfer.base import DEFAULT_CHUNK_BYTES, KvTransport, PushFailed
from cluster.kv_transfer.handoff import TurnHandoffs
from cluster.kv_transfer.sender import PushSender
from cluster.node_metrics import NodeMetrics
from cluster.proto_convert import (
    fingerprint_from_proto,
    fingerprint_to_proto,
    logprob_to_proto,
    sampling_from_proto,
)
from cluster.request_timing import RequestTimer
from cluster.rpc_status import DECODE, PREFILL, RpcFailure
from engine.commands import AbortRequest
from engine.pd_fingerprint import Fingerprint
from engine.pd_prefill import push_request
from engine.scheduler import token_stop
from prefill_node.decode_gate import DecodeGate, OpenDecodeGate
from protos import node_pb2, node_pb2_grpc

log = logging.getLogger("prefill_node")


class PrefillService(node_pb2_grpc.PrefillNodeServicer):
    def __init__(self, engine, transport: KvTransport, fingerprint: Fingerprint,
                 node_id: str = "prefill", model_id: str = "",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, decode_gate: DecodeGate | None = None,
                 metrics: NodeMetrics | None = None, push_per_layer: bool = True,
                 handoffs: TurnHandoffs | None = None):
        """metrics: the node's request and KV push metrics (None: not observed).
        push_per_layer: each layer's KV leaves as the forward writes it; False: a step's
        layers leave together after its forward (cluster/kv_transfer/sender.py).
        handoffs: where the pushes count what a step handed them and not yet delivered
        (cluster/kv_transfer/handoff.py; None: nobody waits for it)."""
        self.engine = engine
        self.push_per_layer = push_per_layer
        self.handoffs = handoffs
        self.metrics = metrics
        self.decode_gate = decode_gate or OpenDecodeGate()
        self.transport = transport
        self.fingerprint = fingerprint
        self.node_id = node_id
        self.model_id = model_id
        self.chunk_bytes = chunk_bytes
        self.draining = False
        self.inflight: dict[str, PushSender] = {}

    @property
    def in_flight(self) -> int:
        return len(self.inflight)

    async def Prefill(self, request: node_pb2.PrefillRequest, context):
        """The stream: a FirstToken as soon as the prompt's first token is sampled (when
        it cannot end the request), then the PrefillReply once the push is acknowledged."""
        reply = await self.prefill(request, context, early=context.write)
        await context.write(node_pb2.PrefillEvent(reply=reply))

    async def prefill(self, request: node_pb2.PrefillRequest, context, early=None
                      ) -> node_pb2.PrefillReply:
        """Run the prefill and the push; the reply once the decode node acknowledged it.
        early: an async callable given the PrefillEvent of the first token, awaited as
        soon as that token is sampled, while the push goes on (None: not sent)."""
        rid = request.request_id
        timer = RequestTimer(self.metrics, "prefill_node.Prefill", tracing.incoming(context),
                             rid)
        if request.decode_address and not await self.decode_gate.admits(
                request.decode_address):
            # refused before any dial, the abort notice included: the address is not ours
            # to contact (a caller cannot aim this node at an arbitrary host). The decode
            # side is what is wrong, and this node is fine: the router tries another pair.
            log.warning("request %s: refused to push to %r: not a registered decode node",
                        rid, request.decode_address)
            await RpcFailure(grpc.StatusCode.PERMISSION_DENIED,
                             f"decode address {request.decode_address!r} is not a registered "
                             f"decode node (allowed: {self.decode_gate.describe()})",
                             DECODE, replay=True).abort(context)
        invalid = self._invalid(request)
        if invalid:
            await self._notify_decode(request, invalid)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, invalid)
        if self.draining:
            await self._notify_decode(request, "prefill node is draining")
            await RpcFailure(grpc.StatusCode.UNAVAILABLE, "prefill node is draining", PREFILL,
                             True).abort(context)
        diff = self.fingerprint.mismatches(fingerprint_from_proto(request.decode_fingerprint))
        if diff:
            msg = "KV fingerprint mismatch (prefill node vs decode node): " + "; ".join(diff)
            await self._notify_decode(request, msg)
            await RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, msg, PREFILL).abort(context)
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as exc:
            await self._notify_decode(request, f"bad sampling params: {exc}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {exc}")

        skip = request.num_cached_blocks
        header = node_pb2.PushHeader(request_id=rid, reservation_id=request.reservation_id,
                                     fingerprint=fingerprint_to_proto(self.fingerprint),
                                     block_ids=list(request.block_ids)[skip:],
                                     push_token=request.push_token)
        sender = PushSender(asyncio.get_running_loop(), header, self.fingerprint.dtype,
                            self.chunk_bytes,
                            raw_payload=getattr(self.transport, "wants_raw_payload", False),
                            lease_ms=request.lease_ms, per_layer=self.push_per_layer,
                            handoffs=self.handoffs)

        try:
            command = push_request(rid, list(request.prompt_token_ids), params,
                                   list(request.block_ids), skip, sender,
                                   self.engine.config.block_size)
            seq = await asyncio.wrap_future(self.engine.submit(command))
        except ValueError as exc:
            await self._notify_decode(request, str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        timer.seq = seq
        self.inflight[rid] = sender
        peer = request.decode_address
        first = None if early is None else asyncio.ensure_future(
            self._send_first(sender, params, len(request.prompt_token_ids), early))
        try:
            await self.transport.push(request.decode_address, sender.messages())
        except PushFailed as exc:
            self._push_failed(peer, "prefill_error" if sender.error is not None
                              else exc.code.name.lower())
            self._abort_engine(rid)
            if sender.error is not None:
                msg = f"prefill failed: {sender.error}"
                await self._notify_decode(request, msg)
                await RpcFailure(grpc.StatusCode.INTERNAL, msg, PREFILL).abort(context)
            await self._notify_decode(request, f"push refused: {exc.message}")
            await RpcFailure(exc.code, f"decode node {request.decode_address} refused the KV "
                             f"push of request {rid}: {exc.message}", exc.side).abort(context)
        except (OSError, RuntimeError, ValueError) as exc:    # a transport bug or a lost socket
            log.exception("request %s: KV push failed", rid)
            self._push_failed(peer, "transport_error")
            self._abort_engine(rid)
            await self._notify_decode(request, f"KV push failed: {exc}")
            await RpcFailure(grpc.StatusCode.UNAVAILABLE, f"KV push of request {rid} to "
                             f"{request.decode_address} failed: {exc}", DECODE).abort(context)
        except asyncio.CancelledError:       # the router went away
            self._push_failed(peer, "cancelled")
            self._abort_engine(rid)
            await self._notify_decode(request, "prefill cancelled by its caller")
            raise
        finally:
            sender.end()
            self.inflight.pop(rid, None)
            if first is not None and not first.done():
                if sender.first_token is None:    # failed before its token: none to send
                    first.cancel()
                await asyncio.gather(first, return_exceptions=True)
        if self.metrics is not None:      # the push's own time: first layer -> the reply
            began = sender.first_layer_at
            self.metrics.pushed(peer, sender.num_bytes,
                                time.monotonic() - began if began is not None else 0.0)
        timer.prefilled(push_started=sender.first_layer_at)
        reply = node_pb2.PrefillReply(first_token_id=sender.first_token,
                                      num_pushed_blocks=len(sender.blocks_pushed),
                                      pushed_bytes=sender.num_bytes,
                                      prefix_cached_tokens=seq.num_prefix_hit_tokens)
        if sender.first_logprob is not None:
            reply.first_logprob.CopyFrom(logprob_to_proto(sender.first_logprob))
        log.info("request %s: prefilled %d tokens, pushed %d blocks (%.1f MB) to %s",
                 rid, len(request.prompt_token_ids), len(sender.blocks_pushed),
                 sender.num_bytes / 1e6, request.decode_address)
        return reply

    async def _send_first(self, sender: PushSender, params, prompt_len: int, write) -> None:
        """The first token, to the router at once, unless it ends the request (EOS, a stop
        token id, max_tokens 1, max_model_len): then only the decode node's stream carries
        it, with the finish. The decode node repeats a token sent here as its first."""
        token, logprob = await sender.sampled
        eng = self.engine
        if token_stop(token, params, eng.eos_token_ids, 1, prompt_len + 1,
                      eng.max_model_len) is not None:
            return
        event = node_pb2.FirstToken(token_id=token)
        if logprob is not None:
            event.logprob.CopyFrom(logprob_to_proto(logprob))
        await write(node_pb2.PrefillEvent(first_token=event))

    @staticmethod
    def _invalid(request: node_pb2.PrefillRequest) -> str | None:
        missing = [name for name in ("request_id", "decode_address", "reservation_id")
                   if not getattr(request, name)]
        if missing:
            return f"missing field(s): {', '.join(missing)}"
        if not request.prompt_token_ids:
            return "prompt_token_ids is empty: at least one token is required"
        if not request.push_token:
            return "missing field: push_token (the Reservation's push_token)"
        if not request.HasField("decode_fingerprint"):
            return "missing field: decode_fingerprint (the Reservation's fingerprint)"
        if request.num_cached_blocks > len(request.block_ids):
            return (f"num_cached_blocks {request.num_cached_blocks} exceeds the "
                    f"{len(request.block_ids)} block ids")
        return None

    def _push_failed(self, peer: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.push_failed(peer, reason)

    def _abort_engine(self, request_id: str) -> None:
        self.engine.submit(AbortRequest(request_id))

    async def _notify_decode(self, request: node_pb2.PrefillRequest, reason: str) -> None:
        if request.decode_address and request.reservation_id and \
                self.decode_gate.allows(request.decode_address):
            await self.transport.abort_reservation(request.decode_address, node_pb2.AbortRequest(
                request_id=request.request_id, reservation_id=request.reservation_id,
                reason=reason, push_token=request.push_token))

    async def AbortPrefill(self, request: node_pb2.AbortRequest, context):
        """Only with the push token the request's Prefill call carried."""
        sender = self.inflight.get(request.request_id)
        if sender is not None and not (request.push_token and hmac.compare_digest(
                request.push_token, sender.header.push_token)):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"request {request.request_id!r}: missing or wrong push token")
        if sender is not None:
            self._abort_engine(request.request_id)
            sender.cancel(RuntimeError(f"aborted: {request.reason}"))
        return node_pb2.AbortReply(found=sender is not None)

    async def GetNodeInfo(self, request, context):
        return node_pb2.NodeInfo(node_id=self.node_id, role="prefill", model_id=self.model_id,
                                 max_model_len=self.engine.max_model_len,
                                 fingerprint=fingerprint_to_proto(self.fingerprint))
