"""Tensors <-> raw bytes and the chunking of one layer's K/V into KvChunk messages."""

from __future__ import annotations

import math
import warnings

import torch

from protos import node_pb2


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a host tensor (any dtype, bf16 included)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    with warnings.catch_warnings():       # read-only buffer: we never write through it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def tensor_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a host tensor (it keeps the tensor alive)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def layer_chunk_parts(layer: int, dst_block_ids: list[int], k: torch.Tensor, v: torch.Tensor,
                      dtype: str, max_bytes: int) -> list[tuple[node_pb2.KvChunk, torch.Tensor]]:
    """K then V of one layer, each split into runs of whole blocks of <= max_bytes:
    (chunk metadata without data, the tensor slice holding its bytes)."""
    per_block = math.prod(k.shape[1:]) * k.element_size()
    step = max(1, max_bytes // per_block)
    parts = []
    for kind, t in ((node_pb2.KV_KIND_KEY, k), (node_pb2.KV_KIND_VALUE, v)):
        if t.numel() == 0:        # a layout without V (MLA's latent cache): nothing to send
            continue
        for i in range(0, len(dst_block_ids), step):
            part = t[i:i + step]
            parts.append((node_pb2.KvChunk(layer=layer, kind=kind,
                                           block_ids=dst_block_ids[i:i + step],
                                           shape=list(part.shape), dtype=dtype), part))
    return parts


def step_chunk_parts(layers: list[tuple[int, torch.Tensor, torch.Tensor]],
                     dst_block_ids: list[int], dtype: str, max_bytes: int
                     ) -> list[tuple[node_pb2.KvChunk, list[torch.Tensor]]]:
    """A step's layers of one push, (layer, k, v) in layer order, all for the same blocks:
    runs of consecutive layers whose K and V fit in max_bytes as one KV_KIND_KEY_VALUE chunk
    each ([num_layers, 2, n, block_size, heads, dim]: the tensors k0, v0, k1, v1, ... in
    wire order, not copied together; [num_layers, 1, ...] of K alone for a layout without V,
    MLA's latent cache); a layer too large for one chunk is split as
    layer_chunk_parts splits it. Why: every chunk costs both nodes a frame's worth of
    Python (parse, validate, hand to the event loop); two per layer made a 256-token
    prompt 60 chunks, and on a 2-core box that per-chunk work, not the bytes, was most of
    a push (issue 36)."""
    parts: list[tuple[node_pb2.KvChunk, list[torch.Tensor]]] = []
    run: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def flush() -> None:
        if not run:
            return
        k0, kinds = run[0][1], 1 if run[0][2].numel() == 0 else 2
        meta = node_pb2.KvChunk(layer=run[0][0], kind=node_pb2.KV_KIND_KEY_VALUE,
                                num_layers=len(run), block_ids=dst_block_ids,
                                shape=[len(run), kinds, *k0.shape], dtype=dtype)
        parts.append((meta, [t for _, k, v in run for t in (k, v)[:kinds]]))
        run.clear()

    for layer, k, v in layers:
        if v.numel() and v.shape != k.shape:    # K and V of different widths: apart
            flush()
            parts.extend((meta, [t]) for meta, t in
                         layer_chunk_parts(layer, dst_block_ids, k, v, dtype, max_bytes))
            continue
        size = (k.numel() + v.numel()) * k.element_size()
        if size > max_bytes:
            flush()
            parts.extend((meta, [t]) for meta, t in
                         layer_chunk_parts(layer, dst_block_ids, k, v, dtype, max_bytes))
            continue
        contiguous = not run or (layer == run[-1][0] + 1)
        if run and (not contiguous or (len(run) + 1) * size > max_bytes):
            flush()
        run.append((layer, k, v))
    flush()
    return parts


def layer_chunks(layer: int, dst_block_ids: list[int], k: torch.Tensor, v: torch.Tensor,
                 dtype: str, max_bytes: int) -> list[node_pb2.KvChunk]:
    """layer_chunk_parts with the bytes inside the messages (gRPC)."""
    chunks = []
    for meta, part in layer_chunk_parts(layer, dst_block_ids, k, v, dtype, max_bytes):
        meta.data = tensor_bytes(part)
        chunks.append(meta)
    return chunks
