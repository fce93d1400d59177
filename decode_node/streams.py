"""Per-request token streams of a decode node: engine outputs -> TokenEvents.

The engine loop hands every step's `EngineOutput`s to `deliver` (its outbox, on the
engine thread); they hop to the event loop, where each lands on its request's queue as a
TokenEvent. Text, stop strings and logprob entries were made by the engine already. A
stream ends with its finishing event, or with a `RpcFailure` (`fail`, any thread) that
the Decode call turns into its status. `relay` is that last hop, shared by a decode
node's admitted requests and an aggregated node's self-prefilled ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cluster.proto_convert import token_event
from cluster.request_timing import RequestTimer
from cluster.rpc_status import RpcFailure
from engine.commands import EngineOutput
from protos import node_pb2


@dataclass
class RequestStream:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    reservation_id: str = ""
    done: bool = False          # its last item (finish or failure) is queued
    relayed_end: bool = False   # `relay` took its last item: the call ended it


async def relay(stream: RequestStream, context, timer: RequestTimer,
                self_prefilled: bool) -> AsyncIterator[node_pb2.DecodeEvent]:
    """The stream's token batches as DecodeEvents, until the finishing one; a failure
    queued instead ends the call with its status (raises, as context.abort does). Either
    way `stream.relayed_end` is set first, so the caller's cleanup knows the request
    ended on the node's side and needs no abort. self_prefilled: see RequestTimer.tokens."""
    while True:
        item = await stream.queue.get()
        if isinstance(item, RpcFailure):
            stream.relayed_end = True
            await item.abort(context)
        timer.tokens(len(item.token_ids), self_prefilled=self_prefilled)
        if item.finish_reason:
            timer.finished(item.finish_reason)
        yield node_pb2.DecodeEvent(tokens=item)
        if item.finish_reason:
            stream.relayed_end = True
            return


class StreamTable:
    """Touched only on the event loop; `deliver` and `fail` may be called from any thread."""

    def __init__(self) -> None:
        self.streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def open(self, request_id: str) -> RequestStream | None:
        """None when the id is already streaming."""
        if request_id in self.streams:
            return None
        stream = self.streams[request_id] = RequestStream(request_id)
        return stream

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def deliver(self, outputs: list[EngineOutput]) -> None:
        """The engine loop's outbox (engine thread)."""
        self._post(self._deliver, outputs)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:      # the event loop is gone (shutdown): nobody to tell
            pass

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None or stream.done:
                continue
            stream.done = out.finished
            stream.queue.put_nowait(token_event(out))

    def fail(self, request_id: str, failure: RpcFailure) -> None:
        """End a stream with an error (any thread)."""
        self._post(self._fail, request_id, failure)

    def _fail(self, request_id: str, failure: RpcFailure) -> None:
        stream = self.streams.get(request_id)
        if stream is not None and not stream.done:
            stream.done = True
            stream.queue.put_nowait(failure)
