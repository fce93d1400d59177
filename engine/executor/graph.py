"""Graph-replayed decode (docs/ARCHITECTURE.md, 'The execution trunk', step 4.2): capture on a
bucket key's first sight, replay through persistent buffers afterwards, eager for
everything a graph cannot hold.

forward(fi)
  plan                 a fallback reason (counted, eager) or the bucket's GraphKey
  bind                 copy the live batch into the persistent buffers, pad the rest
  capture (first sight of the key)
    on the capture stream: warm-up runs (GPU), capture_begin, forward over the buffers,
    copy into the persistent hidden-state buffer, capture_end; one test replay; the
    current stream waits for the capture stream. All graphs share one memory pool.
  replay (bucket hit)
  -> the persistent hidden-state rows of the live batch (a view: valid until the next
     forward; copy it to keep it)

The same code runs on CUDA (CUDAGraph), NPU (NPUGraph) and CPU, where the "graph"
reruns the captured callable over the same buffers (engine/device.py), so the binding
and padding logic is exercised by the CPU tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from engine.device import Device
from engine.executor.eager import EagerExecutor
from engine.executor.graph_buckets import GraphBuckets, GraphKey, GraphOptions
from engine.executor.graph_buffers import GraphBuffers
from engine.executor.graph_stats import GraphStats
from engine.forward_input import ForwardInput
from engine.kv_cache import KVCache

log = logging.getLogger(__name__)


def _tokens_per_seq(fi: ForwardInput) -> int:
    a = fi.attn
    return a.num_decode_tokens // a.num_decodes if a.num_decodes else 1


def _longest_seq(fi: ForwardInput) -> int:
    a = fi.attn
    return max(a.seq_lens_host[:a.num_decodes], default=0)


# Fallbacks in the order they are checked; the first that applies names the reason.
# Each reads host-side fields only (no device sync).
FALLBACKS: tuple[tuple[str, Callable[[GraphExecutor, ForwardInput], bool]], ...] = (
    # a one-layer model (an MTP draft) is too short for replay to pay off
    ("single_layer", lambda ex, fi: ex.num_layers == 1),
    ("prefill", lambda ex, fi: fi.attn.num_prefills > 0 and fi.attn.num_decodes == 0),
    # decodes batched with prefill chunks: the shapes follow the chunk
    ("chunked_prefill", lambda ex, fi: fi.attn.num_prefills > 0),
    ("batch_too_large",
     lambda ex, fi: ex.buckets.bucket(fi.attn.num_decodes + fi.attn.num_padding) is None),
    ("verify_too_wide", lambda ex, fi: _tokens_per_seq(fi) > ex.options.max_tokens_per_seq),
    ("seq_too_long", lambda ex, fi: _longest_seq(fi) > ex.options.max_seq_len),
)


class GraphExecutor:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: Device,
                 options: GraphOptions):
        self.model, self.kv_cache, self.device, self.options = model, kv_cache, device, options
        self.eager = EagerExecutor(model, kv_cache)
        self.num_layers = model.config.num_hidden_layers
        self.buckets = GraphBuckets(options.max_batch_size, options.padding,
                                    options.batch_sizes)
        dtype = next(model.parameters()).dtype
        self.buffers = GraphBuffers(self.buckets.largest, options.max_tokens_per_seq,
                                    options.max_blocks_per_seq, options.block_size,
                                    model.output_width, dtype, device.torch_device)
        self.pool = device.graph_pool_handle()
        self.capture_stream = device.new_stream(high_priority=True)
        self.graphs: dict[GraphKey, object] = {}
        self.graph_stats = GraphStats()
        self._logged_reasons: set[str] = set()

    # ---- the forward ---------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fi: ForwardInput) -> torch.Tensor:
        key = self.plan(fi)
        if isinstance(key, str):
            self._count_fallback(key)
            return self.eager.forward(fi)
        self.buffers.bind(fi, key)
        graph = self.graphs.get(key)
        if graph is None:
            self.capture(key)
        else:
            graph.replay()
            self.graph_stats.replays += 1
        return self.buffers.hidden[:fi.num_tokens]

    def plan(self, fi: ForwardInput) -> GraphKey | str:
        """The key this batch replays under, or the reason it runs eagerly."""
        for reason, applies in FALLBACKS:
            if applies(self, fi):
                return reason
        a = fi.attn
        q = _tokens_per_seq(fi)
        return GraphKey(self.buckets.bucket(a.num_decodes + a.num_padding) * q, q)

    def _count_fallback(self, reason: str) -> None:
        self.graph_stats.fallbacks[reason] += 1
        level = logging.DEBUG if reason in self._logged_reasons else logging.INFO
        self._logged_reasons.add(reason)
        log.log(level, "graph executor: eager step (%s)", reason)

    # ---- capture -------------------------------------------------------------------
    def capture(self, key: GraphKey) -> None:
        """Capture the graph of `key` over the buffers as bound now, test-replay it (which
        computes this step's hidden states) and keep it."""
        buf = self.buffers
        t = key.num_tokens
        tokens, positions, hidden = buf.token_ids[:t], buf.positions[:t], buf.hidden[:t]
        meta = buf.metadata(key)
        model, kv_cache = self.model, self.kv_cache

        def run() -> None:
            # the model prepares its attention plan from `meta` (the buffers) in here, so
            # each replay (a CPU graph reruns this callable) rebuilds it from the tensors
            hidden.copy_(model(tokens, positions, kv_cache, meta))

        dev, stream = self.device, self.capture_stream
        started = time.perf_counter()
        with dev.capture_lock:
            current = dev.current_stream()
            stream.wait_stream(current)     # the binding copies ran on the current stream
            with dev.stream(stream):
                for _ in range(dev.capture_warmup_iters):
                    run()   # rewrites this step's K/V with the same values: harmless
            graph = dev.capture_graph(run, self.pool, stream)
            with dev.stream(stream):
                graph.replay()
            current.wait_stream(stream)
        self.graphs[key] = graph
        self.graph_stats.captures += 1
        log.info("graph executor: captured %d tokens x %d per sequence in %.0f ms "
                 "(%d graphs)", key.num_tokens, key.tokens_per_seq,
                 1e3 * (time.perf_counter() - started), len(self.graphs))

    @torch.inference_mode()
    def warmup(self, batch_sizes: tuple[int, ...] | list[int] = (),
               progress: bool = True) -> list[GraphKey]:
        """Capture the buckets of `batch_sizes` (every bucket when empty) over a batch of
        padding rows, largest first so smaller graphs reuse the pool's memory."""
        sizes = batch_sizes or self.buckets.all()
        buckets = sorted({self.buckets.bucket(s) for s in sizes} - {None}, reverse=True)
        keys = [GraphKey(b) for b in buckets if GraphKey(b) not in self.graphs]
        for key in tqdm(keys, desc="capture decode graphs", unit="graph",
                        disable=not progress or not keys):
            self.buffers.bind(None, key)
            self.capture(key)
        return keys
