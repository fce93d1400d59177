"""Per-request token streams of a decode node: engine outputs -> TokenEvents.

The engine loop hands every step's `EngineOutput`s to `deliver` (its outbox, on the
engine thread); they hop to the event loop, where each lands on its request's queue as a
TokenEvent. Text, stop strings and logprob entries were made by the engine already. A
stream ends with its finishing event, or with a `RpcFailure` (`fail`, any thread) that
the Decode call turns into its status.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from cluster.proto_convert import token_event
from cluster.rpc_status import RpcFailure
from engine.commands import EngineOutput


@dataclass
class RequestStream:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    reservation_id: str = ""
    done: bool = False


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
