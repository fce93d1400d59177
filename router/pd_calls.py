"""The two calls of a PD attempt, read as the attempt's outcome: the prefill node's
Prefill stream (its early first token, then its reply) and the results of the decode node's
Decode stream, each failure classified from the node's trailers (cluster/rpc_status.py) into
a node to drop (NodeFailure) or a unit to pass over (TryOther)."""

from __future__ import annotations

import asyncio

import grpc

from cluster.rpc_status import DECODE, PREFILL, failure_of
from protos import node_pb2
from router.errors import NodeFailure
from router.node_calls import classify_failure
from router.node_pool import NodeState


async def prefill_reply(call, early: asyncio.Future) -> node_pb2.PrefillReply:
    """Read a Prefill stream: its FirstToken onto `early`, and return its PrefillReply
    (a stream without one fails the attempt on the prefill node)."""
    async for event in call:
        if event.HasField("first_token"):
            if not early.done():
                early.set_result(event.first_token)
        elif event.HasField("reply"):
            return event.reply
    raise RuntimeError("the Prefill stream ended without a reply")


def check_prefill(task: asyncio.Task, pre: NodeState, dec: NodeState) -> None:
    """A finished Prefill call: fine, or the reason this attempt ends."""
    if task.cancelled():
        raise NodeFailure(pre.node_id, "the prefill call was cancelled")
    exc = task.exception()
    if exc is None:
        return
    if not isinstance(exc, grpc.aio.AioRpcError):
        raise NodeFailure(pre.node_id, f"prefill call failed: {exc!r}")
    failure = failure_of(exc, PREFILL)
    raise classify_failure(failure, dec if failure.side == DECODE else pre)


async def decode_result(read: asyncio.Future, dec: NodeState, prefill: asyncio.Task | None,
                         pre: NodeState):
    try:
        return read.result()
    except grpc.aio.AioRpcError as exc:
        failure = failure_of(exc, DECODE)
        if failure.code == grpc.StatusCode.ABORTED and failure.side == PREFILL \
                and prefill is not None:
            # "prefill failed": the Prefill call carries the root cause (bad argument,
            # fingerprint mismatch, a dead prefill node); it may land a moment later.
            if not prefill.done():
                await asyncio.wait({prefill}, timeout=5.0)
            if prefill.done():
                check_prefill(prefill, pre, dec)
        raise classify_failure(failure, pre if failure.side == PREFILL else dec) from None
