"""The Worker's executor, chosen from the configuration: eager, or graph-replayed decode."""

from __future__ import annotations

import torch

from engine.device import Device
from engine.executor.eager import EagerExecutor
from engine.executor.graph_buckets import GraphOptions
from engine.kv_cache import KVCache


def build_executor(model: torch.nn.Module, kv_cache: KVCache, device: Device,
                   graph: GraphOptions | None = None):
    """`graph=None`: eager. Otherwise a GraphExecutor, with its warm-up captures done."""
    if graph is None:
        return EagerExecutor(model, kv_cache)
    from engine.executor.graph import GraphExecutor
    executor = GraphExecutor(model, kv_cache, device, graph)
    if graph.warmup_batch_sizes:
        executor.warmup(graph.warmup_batch_sizes)
    return executor
