"""Per-request token streams of a decode node: engine-thread results -> TokenEvents.

`emit(seq)` runs under the engine lock (on the engine thread after a step, or right
after admission) and posts what the sequence gained since its last event onto the
request's asyncio queue: token ids, the text delta (stop strings applied as in the
single-node LLM), logprobs, and on the last event the finish reason and usage.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from cluster.kv_transfer.base import PushFailed
from cluster.proto_convert import FINISH_REASONS, logprob_to_proto
from engine.output_processor import OutputProcessor
from engine.sequence import Sequence
from protos import common_pb2, node_pb2


@dataclass
class RequestStream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    reservation_id: str = ""
    sent_tokens: int = 0
    sent_text: int = 0
    done: bool = False
    seq: Sequence | None = None           # set once admitted

    def post(self, item: node_pb2.TokenEvent | PushFailed) -> None:
        """Thread-safe: enqueue an event (or the error that ends the stream)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class StreamTable:
    def __init__(self, engine, output_processor: OutputProcessor):
        self.engine = engine
        self.output_processor = output_processor
        self.streams: dict[str, RequestStream] = {}

    def emit(self, seq: Sequence) -> None:
        """Caller holds the engine lock."""
        stream = self.streams.get(seq.request_id)
        if stream is None or stream.done:
            return
        stream.seq = seq
        stop = self.output_processor.update(seq)
        if stop is not None and not seq.is_finished:
            self.engine.scheduler.finish(seq, "stop", stop)
        out = seq.output_token_ids
        new = out[stream.sent_tokens:]
        text = self.output_processor.text(seq)
        delta = text[stream.sent_text:] if len(text) > stream.sent_text else ""
        if not new and not seq.is_finished:
            return
        event = node_pb2.TokenEvent(token_ids=new, text_delta=delta)
        if seq.params.logprobs is not None:
            for i, tok in enumerate(new, start=stream.sent_tokens):
                if i < len(seq.logprobs):
                    event.logprobs.append(logprob_to_proto(tok, seq.logprobs[i]))
        stream.sent_tokens, stream.sent_text = len(out), max(stream.sent_text, len(text))
        if seq.is_finished:
            event.finish_reason = FINISH_REASONS.get(seq.finish_reason,
                                                     common_pb2.FINISH_REASON_ABORT)
            if seq.stop_reason is not None:
                event.stop_reason = str(seq.stop_reason)
            event.usage.CopyFrom(common_pb2.Usage(
                prompt_tokens=seq.num_prompt_tokens, completion_tokens=len(out),
                cached_prompt_tokens=seq.num_prefix_hit_tokens))
            stream.done = True
            self.engine.release(seq.request_id)
            self.output_processor.forget(seq)
        stream.post(event)

    def emit_all(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.emit(seq)

    def reap(self) -> None:
        """Streams whose sequence ended without a new token (aborted by an engine error)."""
        for stream in list(self.streams.values()):
            if stream.seq is not None and stream.seq.is_finished and not stream.done:
                self.emit(stream.seq)

    def fail(self, request_id: str, error: PushFailed) -> None:
        stream = self.streams.get(request_id)
        if stream is not None and not stream.done:
            stream.done = True
            stream.post(error)
