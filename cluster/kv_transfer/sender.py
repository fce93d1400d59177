"""The prefill side of a push: engine-thread callbacks (engine.pd_prefill.KvSink) become
an async stream of KvPushMessage: the header, each layer's K/V chunks as soon as the layer
is written (or, `per_layer=False`, a step's layers together once its forward is done),
then `done` with the first sampled token. The token is also on `sampled` at once, for the
prefill node to stream ahead of the push's end."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from cluster.kv_transfer.base import DEFAULT_CHUNK_BYTES
from cluster.kv_transfer.codec import (
    layer_chunk_parts,
    step_chunk_parts,
    tensor_bytes,
    tensor_view,
)
from cluster.kv_transfer.handoff import TurnHandoffs
from cluster.kv_transfer.mtp_payload import handoff_to_proto
from cluster.proto_convert import logprob_to_proto
from engine.logprobs import TokenLogprob
from protos import node_pb2


# What the engine thread hands the event loop, one typed event per callback.
@dataclass(frozen=True)
class LayerReady:
    layer: int
    dst_block_ids: list[int]
    k: torch.Tensor
    v: torch.Tensor
    ready: object | None          # a device event to wait on before reading k, v


@dataclass(frozen=True)
class StepLayers:
    layers: tuple[LayerReady, ...]    # a step's layers, sent together
    taken: Callable[[], None] | None = None   # closer: the transport took them (handoff.py)


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    logprob: TokenLogprob | None
    mtp: object | None            # engine.pd_mtp.MtpHandoff


@dataclass(frozen=True)
class PushError:
    error: BaseException


PushEvent = LayerReady | StepLayers | FirstToken | PushError

# A push silent this long sends a keepalive, which renews the decode node's lease, so only
# a hung or dead sender loses one: a quarter of the granted lease (several keepalives fit
# in it even when this process is starved of CPU), at most KEEPALIVE_S.
KEEPALIVE_S = 2.0
MIN_KEEPALIVE_S = 0.05


def keepalive_interval(lease_ms: int) -> float:
    """Seconds between keepalives for a reservation granted `lease_ms` (0: not told)."""
    if lease_ms <= 0:
        return KEEPALIVE_S
    return min(KEEPALIVE_S, max(MIN_KEEPALIVE_S, lease_ms / 4000))


class PushSender:
    """One request's push. The on_* methods run on the engine thread and only enqueue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, header: node_pb2.PushHeader,
                 dtype: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, raw_payload: bool = False,
                 lease_ms: int = 0, per_layer: bool = True,
                 handoffs: TurnHandoffs | None = None):
        """per_layer: hand each layer to the event loop as the forward writes it, so the
        push overlaps the compute. False: a step's layers go together after its forward,
        one wake-up of the event loop and the sending threads per step instead of one per
        layer: on a CPU those threads take the cores from the forward's OpenMP team, and
        every layer they preempt stalls the whole team (prefill_node/node.py).
        handoffs: with per_layer=False, each step's KV counts as outstanding there until the
        transport took it, and the last step's until the decode node answered the push
        (`end()`): the node keeps its turn on shared cores meanwhile (handoff.py)."""
        self.loop = loop
        self.per_layer = per_layer
        self._held: list[LayerReady] = []       # engine thread only (per_layer=False)
        self.handoffs = handoffs if not per_layer else None
        self._closers: list[Callable[[], None]] = []   # every closer opened (for end())
        self._closers_lock = threading.Lock()
        # raw_payload: yield (message, bytes view) pairs for transports that move chunk
        # bytes outside the message (no copy into protobuf)
        self.raw_payload = raw_payload
        self.header = header
        self.dtype = dtype
        self.chunk_bytes = chunk_bytes
        self._queue: asyncio.Queue = asyncio.Queue()
        self.first_token: int | None = None
        self.first_logprob: TokenLogprob | None = None
        self.error: BaseException | None = None
        self.num_chunks = 0
        self.num_bytes = 0
        self.blocks_pushed: set[int] = set()
        # time.monotonic() when the first layer's KV was ready to send (None: none was):
        # where the push's own time starts (before it, the request queued or computed)
        self.first_layer_at: float | None = None
        # (token id, logprob) the moment the step sampled it, ahead of the chunks queued
        # before it: the service streams it to the router while the KV still travels
        self.sampled: asyncio.Future = loop.create_future()
        self.keepalive_s = keepalive_interval(lease_ms)

    # ---- engine thread (KvSink) ----------------------------------------------------
    def _put(self, event: PushEvent) -> None:
        self.loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def on_layer(self, layer: int, dst_block_ids: list[int], k: torch.Tensor,
                 v: torch.Tensor, ready: object | None) -> None:
        event = LayerReady(layer, dst_block_ids, k, v, ready)
        if self.per_layer:
            self._put(event)
        else:
            self._held.append(event)

    def _open_handoff(self) -> Callable[[], None] | None:
        if self.handoffs is None:
            return None
        close = self.handoffs.open()
        with self._closers_lock:
            self._closers.append(close)
        return close

    def on_step_end(self) -> None:
        if self._held:
            self._put(StepLayers(tuple(self._held), self._open_handoff()))
            self._held = []

    def on_first_token(self, token_id: int, logprob: TokenLogprob | None,
                       mtp=None) -> None:
        # the prompt's last step: outstanding until the decode node answers (end())
        self._open_handoff()
        self.loop.call_soon_threadsafe(self._sampled, token_id, logprob)   # runs first
        self._put(FirstToken(token_id, logprob, mtp))

    def _sampled(self, token_id: int, logprob: TokenLogprob | None) -> None:
        if not self.sampled.done():
            self.sampled.set_result((token_id, logprob))

    def on_error(self, exc: BaseException) -> None:
        self._put(PushError(exc))

    def end(self) -> None:
        """The push is over (answered, refused or failed): nothing of it is outstanding."""
        with self._closers_lock:
            closers, self._closers = self._closers, []
        for close in closers:
            close()

    def cancel(self, exc: BaseException) -> None:
        """From the event loop: end the stream without `done` (the receiver then refuses)."""
        self._queue.put_nowait(PushError(exc))

    # ---- event loop ----------------------------------------------------------------
    async def messages(self) -> AsyncIterator:
        yield node_pb2.KvPushMessage(header=self.header)
        while True:
            try:
                event: PushEvent = await asyncio.wait_for(self._queue.get(),
                                                          self.keepalive_s)
            except TimeoutError:      # queued or computing: tell the decode node we live
                yield node_pb2.KvPushMessage(keepalive=node_pb2.PushKeepalive())
                continue
            if isinstance(event, (LayerReady, StepLayers)):
                layers = event.layers if isinstance(event, StepLayers) else (event,)
                for item in await self._chunks(layers):
                    yield item
                if isinstance(event, StepLayers) and event.taken is not None:
                    event.taken()         # resumed past the last chunk: the transport has it
            elif isinstance(event, FirstToken):
                token, entry = event.token_id, event.logprob
                self.first_token, self.first_logprob = token, entry
                done = node_pb2.PushDone(first_token_id=token, num_chunks=self.num_chunks)
                if entry is not None:
                    done.first_logprob.CopyFrom(logprob_to_proto(entry))
                if event.mtp is not None:     # the decode node's draft starts from it
                    done.mtp.CopyFrom(handoff_to_proto(event.mtp, list(self.header.block_ids)))
                yield node_pb2.KvPushMessage(done=done)
                return
            else:
                self.error = event.error
                return

    async def _chunks(self, layers: tuple[LayerReady, ...]) -> list:
        """Layers' K/V as push messages (with their raw bytes apart, for raw_payload): one
        layer as its K and V chunks, a step's layers (same blocks) in layer runs
        (codec.step_chunk_parts)."""
        if self.first_layer_at is None:
            self.first_layer_at = time.monotonic()
        for event in layers:
            if event.ready is not None:
                await asyncio.to_thread(event.ready.synchronize)
        first = layers[0]
        if len(layers) > 1 and all(e.dst_block_ids == first.dst_block_ids for e in layers):
            parts = step_chunk_parts([(e.layer, e.k, e.v) for e in layers],
                                     first.dst_block_ids, self.dtype, self.chunk_bytes)
        else:
            parts = [(meta, [t]) for e in layers
                     for meta, t in layer_chunk_parts(e.layer, e.dst_block_ids, e.k, e.v,
                                                      self.dtype, self.chunk_bytes)]
        out = []
        for meta, tensors in parts:
            self.num_chunks += 1
            self.num_bytes += sum(t.numel() * t.element_size() for t in tensors)
            if self.raw_payload:
                views = [tensor_view(t) for t in tensors]
                out.append((node_pb2.KvPushMessage(chunk=meta),
                            views[0] if len(views) == 1 else views))
            else:
                meta.data = b"".join(tensor_bytes(t) for t in tensors)
                out.append(node_pb2.KvPushMessage(chunk=meta))
        for event in layers:
            self.blocks_pushed.update(event.dst_block_ids)
        return out
