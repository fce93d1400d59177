"""The decode side of a push, transport-independent: header -> chunks -> done.

Every check happens before bytes are written: the header's reservation must exist, its
push token and request id must be the reservation's (KvReceiver.authorize), and its
fingerprint must equal ours; each chunk is validated by KvReceiver.write
(cluster/kv_transfer/kv_receiver.py);
`done` admits the sequence only when every (layer, K/V, block) arrived. Any refusal raises
PushFailed with the status a gRPC client sees. A refusal of a push that proved its token
releases the reservation so its blocks return to the pool at once; a push that did not
(PERMISSION_DENIED) leaves it alone: the real prefill may still be on its way, and a
stranger must not be able to end someone else's request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from cluster.kv_transfer.base import PushFailed
from cluster.kv_transfer.kv_receiver import (
    KvReceiver,
    PushDenied,
    PushRejected,
    ReleaseReason,
    UnknownReservation,
)
from cluster.kv_transfer.mtp_payload import handoff_from_proto
from cluster.proto_convert import fingerprint_from_proto, logprob_from_proto
from engine.pd_fingerprint import Fingerprint
from protos import node_pb2

log = logging.getLogger("cluster.kv_transfer")

# In place of a chunk's bytes: the transport already wrote them with KvReceiver.write
# (same validation) after this handler had accepted the header.
WRITTEN = object()


class PushHandler:
    """A refusal after the header was authorized releases that reservation
    (PUSH_REFUSED); the receiver's state machine then tells its own stream. A push that
    sends no header within `header_timeout_s` is refused (an idle stream costs nothing)."""

    def __init__(self, receiver: KvReceiver, fingerprint: Fingerprint,
                 header_timeout_s: float = 10.0):
        self.receiver = receiver
        self.fingerprint = fingerprint
        self.header_timeout_s = header_timeout_s

    async def handle(self, messages: AsyncIterator) -> node_pb2.PushAck:
        """`messages`: KvPushMessage, or (KvPushMessage, chunk bytes) pairs from transports
        that carry chunk bytes outside the message (raw TCP)."""
        header = None
        authorized = False          # only an authorized push may release the reservation
        try:
            header = await self._header(messages)
            token = header.push_token
            # unknown -> NOT_FOUND; wrong token / request -> PERMISSION_DENIED, untouched
            res = self.receiver.authorize(header.reservation_id, token, header.request_id)
            authorized = True
            diff = self.fingerprint.mismatches(fingerprint_from_proto(header.fingerprint))
            if diff:
                raise PushFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                 "KV fingerprint mismatch (decode node vs prefill node): "
                                 + "; ".join(diff))
            chunks = 0
            async for item in messages:
                msg, data = item if isinstance(item, tuple) else (item, None)
                which = msg.WhichOneof("msg")
                if which == "keepalive":
                    self.receiver.renew(header.reservation_id, token)
                elif which == "chunk" and data is WRITTEN:
                    self.receiver.renew(header.reservation_id, token)
                    chunks += 1
                elif which == "chunk":
                    c = msg.chunk
                    data = c.data if data is None else data
                    # bytes copy into the cache: off the event loop for large chunks
                    args = (header.reservation_id, c.layer, c.kind, list(c.block_ids),
                            list(c.shape), c.dtype, data)
                    kw = {"token": token, "num_layers": c.num_layers}
                    if len(data) > (1 << 20):
                        await asyncio.to_thread(self.receiver.write, *args, **kw)
                    else:
                        self.receiver.write(*args, **kw)
                    self.receiver.renew(header.reservation_id, token)
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
                                                      done.first_token_id, lp, mtp,
                                                      token=token)
                    # shielded: once complete() accepted the push, the admission must
                    # happen even if this call is cancelled (the blocks are the sequence's)
                    await asyncio.shield(asyncio.wrap_future(admitted))
                    return node_pb2.PushAck(bytes_received=res.bytes_received,
                                            num_chunks=chunks)
                else:
                    raise PushRejected(f"unexpected {which!r} message after the header")
            raise PushRejected("push ended without its final `done` message")
        except PushDenied as exc:
            raise self._fail(None, grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None
        except UnknownReservation as exc:
            raise self._fail(header if authorized else None, grpc.StatusCode.NOT_FOUND,
                             str(exc)) from None
        except PushRejected as exc:
            raise self._fail(header if authorized else None,
                             grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except PushFailed as exc:
            raise self._fail(header if authorized else None, exc.code,
                             exc.message) from None

    async def _header(self, messages) -> node_pb2.PushHeader:
        try:
            first = await asyncio.wait_for(anext(messages), self.header_timeout_s)
        except StopAsyncIteration:
            raise PushRejected("empty push: no header") from None
        except TimeoutError:
            raise PushRejected(f"no push header within {self.header_timeout_s:g} s") from None
        if isinstance(first, tuple):
            first = first[0]
        if first.WhichOneof("msg") != "header":
            raise PushRejected("a push must start with its header")
        return first.header

    def _fail(self, header, code: grpc.StatusCode, message: str) -> PushFailed:
        """header: the authorized push's header (its reservation is released), or None
        (nothing is: no header, or the sender did not prove it holds the reservation)."""
        err = PushFailed(code, message)
        if header is not None:
            log.warning("reservation %s: KV push refused: %s", header.reservation_id, err)
            self.receiver.release(header.reservation_id, ReleaseReason.PUSH_REFUSED, message)
        else:
            log.warning("KV push refused before an accepted header: %s", err)
        return err
