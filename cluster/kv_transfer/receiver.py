"""The decode side of a push, transport-independent: header -> chunks -> done.

Every check happens before bytes are written: the header's reservation must exist and its
fingerprint equal ours; each chunk is validated by engine.pd_decode.KvReceiver.write;
`done` admits the sequence only when every (layer, K/V, block) arrived. Any refusal raises
PushFailed with the status a gRPC client sees, and the reservation is released so its
blocks return to the pool at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from cluster.kv_transfer.base import PushFailed
from cluster.kv_transfer.mtp_payload import handoff_from_proto
from cluster.proto_convert import fingerprint_from_proto, logprob_from_proto
from engine.pd_decode import KvReceiver, PushRejected, ReleaseReason, UnknownReservation
from engine.pd_fingerprint import Fingerprint
from protos import node_pb2

log = logging.getLogger("cluster.kv_transfer")

# In place of a chunk's bytes: the transport already wrote them with KvReceiver.write
# (same validation) after this handler had accepted the header.
WRITTEN = object()


class PushHandler:
    """A refusal releases the reservation named by the header (PUSH_REFUSED); the
    receiver's state machine then tells that reservation's own stream, so a forged
    request id in a header reaches nobody else's request."""

    def __init__(self, receiver: KvReceiver, fingerprint: Fingerprint):
        self.receiver = receiver
        self.fingerprint = fingerprint

    async def handle(self, messages: AsyncIterator) -> node_pb2.PushAck:
        """`messages`: KvPushMessage, or (KvPushMessage, chunk bytes) pairs from transports
        that carry chunk bytes outside the message (raw TCP)."""
        header = None
        try:
            header = await self._header(messages)
            res = self.receiver.get(header.reservation_id)    # unknown -> NOT_FOUND
            diff = self.fingerprint.mismatches(fingerprint_from_proto(header.fingerprint))
            if diff:
                raise PushFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                 "KV fingerprint mismatch (decode node vs prefill node): "
                                 + "; ".join(diff))
            chunks = 0
            async for item in messages:
                msg, data = item if isinstance(item, tuple) else (item, None)
                which = msg.WhichOneof("msg")
                if which == "chunk" and data is WRITTEN:
                    chunks += 1
                elif which == "chunk":
                    c = msg.chunk
                    data = c.data if data is None else data
                    # bytes copy into the cache: off the event loop for large chunks
                    args = (header.reservation_id, c.layer, c.kind, list(c.block_ids),
                            list(c.shape), c.dtype, data)
                    if len(data) > (1 << 20):
                        await asyncio.to_thread(self.receiver.write, *args)
                    else:
                        self.receiver.write(*args)
                    chunks += 1
                elif which == "done":
                    done = msg.done
                    if done.num_chunks and done.num_chunks != chunks:
                        raise PushRejected(f"sender reports {done.num_chunks} chunks, "
                                           f"{chunks} arrived")
                    lp = logprob_from_proto(done.first_logprob) \
                        if done.HasField("first_logprob") else None
                    mtp = handoff_from_proto(done.mtp, res.push_block_ids) \
                        if done.HasField("mtp") else None
                    admitted = self.receiver.complete(header.reservation_id,
                                                      done.first_token_id, lp, mtp)
                    # shielded: once complete() accepted the push, the admission must
                    # happen even if this call is cancelled (the blocks are the sequence's)
                    await asyncio.shield(asyncio.wrap_future(admitted))
                    return node_pb2.PushAck(bytes_received=res.bytes_received,
                                            num_chunks=chunks)
                else:
                    raise PushRejected(f"unexpected {which!r} message after the header")
            raise PushRejected("push ended without its final `done` message")
        except UnknownReservation as exc:
            raise await self._fail(header, grpc.StatusCode.NOT_FOUND, str(exc)) from None
        except PushRejected as exc:
            raise await self._fail(header, grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except PushFailed as exc:
            raise await self._fail(header, exc.code, exc.message) from None

    async def _header(self, messages) -> node_pb2.PushHeader:
        try:
            first = await anext(messages)
        except StopAsyncIteration:
            raise PushRejected("empty push: no header") from None
        if isinstance(first, tuple):
            first = first[0]
        if first.WhichOneof("msg") != "header":
            raise PushRejected("a push must start with its header")
        return first.header

    async def _fail(self, header, code: grpc.StatusCode, message: str) -> PushFailed:
        err = PushFailed(code, message)
        if header is not None:
            log.warning("reservation %s: KV push refused: %s", header.reservation_id, err)
            self.receiver.release(header.reservation_id, ReleaseReason.PUSH_REFUSED, message)
        else:
            log.warning("KV push refused before its header: %s", err)
        return err
