"""decode_node/streams.py `relay`, the token hop both Decode flavours share (a decode
node's admitted request, an aggregated node's self-prefilled one): every batch streamed in
order, and `relayed_end` set exactly when the node ended the request (its finish, or a
failure that ends the call), never when the caller went away first, whose cleanup must
then abort the request."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.request_timing import RequestTimer
from cluster.rpc_status import DECODE, RpcFailure
from decode_node.streams import RequestStream, relay
from protos import common_pb2, node_pb2


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self):
        self.aborted = None

    async def abort(self, code, message, trailing_metadata=()):
        self.aborted = (code, message, dict(trailing_metadata))
        raise Aborted(message)


def _stream(*items) -> RequestStream:
    stream = RequestStream("r1")
    for item in items:
        stream.queue.put_nowait(item)
    return stream


def _tokens(*ids, finish=False) -> node_pb2.TokenEvent:
    event = node_pb2.TokenEvent(token_ids=list(ids))
    if finish:
        event.finish_reason = common_pb2.FINISH_REASON_LENGTH
    return event


async def _collect(stream, context, limit=None):
    got = []
    gen = relay(stream, context, RequestTimer(None), self_prefilled=False)
    async for event in gen:
        got.append(list(event.tokens.token_ids))
        if limit is not None and len(got) == limit:
            await gen.aclose()          # the caller goes away
            break
    return got


def test_relays_every_batch_and_marks_the_finish():
    stream = _stream(_tokens(1), _tokens(2, 3), _tokens(4, finish=True), _tokens(9))
    got = asyncio.run(_collect(stream, FakeContext()))
    assert got == [[1], [2, 3], [4]]          # nothing after the finishing batch
    assert stream.relayed_end


def test_a_failure_ends_the_call_with_its_status():
    failure = RpcFailure(grpc.StatusCode.ABORTED, "lease expired", DECODE, True)
    stream, context = _stream(_tokens(1), failure), FakeContext()
    with pytest.raises(Aborted):
        asyncio.run(_collect(stream, context))
    assert context.aborted[0] == grpc.StatusCode.ABORTED
    assert context.aborted[2]["pdserve-retry"] == "replay"
    assert stream.relayed_end                 # released on the node: nothing to abort


def test_a_caller_that_leaves_before_the_end_is_not_marked():
    stream = _stream(_tokens(1), _tokens(2), _tokens(3, finish=True))
    assert asyncio.run(_collect(stream, FakeContext(), limit=2)) == [[1], [2]]
    assert not stream.relayed_end
    # gone at the finishing batch itself: not taken as delivered either
    stream = _stream(_tokens(1, finish=True))
    assert asyncio.run(_collect(stream, FakeContext(), limit=1)) == [[1]]
    assert not stream.relayed_end
