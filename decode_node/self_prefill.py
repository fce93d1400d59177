"""Aggregated mode on the node side: a Decode call with `self_prefill` runs the whole
request here.

The prompt goes to the engine as a plain AddRequest (the engine's normal add_request: its
prefill, prefix cache and scheduler as a single-node LLM uses them), with no reservation
and no KV push. Its outputs reach the call through the same StreamTable a decode node's
admitted requests use, so the router reads the same TokenEvents, the first token included.
A caller that goes away aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from cluster.request_timing import RequestTimer
from decode_node.streams import StreamTable, relay
from engine.commands import AbortRequest, AddRequest
from engine.sampling_params import SamplingParams
from protos import node_pb2

AGGREGATED = "aggregated"


async def stream_self_prefill(engine, streams: StreamTable, request_id: str,
                              prompt: list[int], params: SamplingParams, context,
                              timer: RequestTimer | None = None
                              ) -> AsyncIterator[node_pb2.DecodeEvent]:
    """TokenEvents of one request prefilled and decoded on this node, until its finish.
    A prompt the engine refuses (too long for the model, a duplicate id) is
    INVALID_ARGUMENT; an engine-side release (e.g. draining) ends the call with its status."""
    stream = streams.open(request_id)
    if stream is None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request id {request_id!r} is already in use")
    finished = False
    timer = timer or RequestTimer(None)
    try:
        try:
            # Opened before the submit: the engine's first output cannot miss the stream.
            timer.seq = await asyncio.wrap_future(
                engine.submit(AddRequest(request_id, prompt, params)))
        except ValueError as exc:
            finished = True          # never added: nothing to abort
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        async for event in relay(stream, context, timer, self_prefilled=True):
            yield event
    finally:
        streams.close(request_id)
        if not (finished or stream.relayed_end):   # the caller went away: stop computing
            engine.submit(AbortRequest(request_id))
