"""Paged decode attention for CPU as a small C++ kernel, built once with torch's
cpp_extension (g++ and ninja) and cached under ~/.cache/torch_extensions.

Why: in pure torch, decode attention must first gather every sequence's blocks into a
dense tensor (index_select), then run two batched matmuls of 3-row products over it: the
KV bytes cross memory about four times, and at batch 64 with ~400-token contexts that was
~60% of a SmolLM2 decode step. The kernel walks each sequence's block table itself and
reads every K and V row once: one task per (query row, KV head), the G query heads of
that KV head scored against each key as it streams by, softmax in float32 over the row's
own length (no padding, no mask), float32 accumulation, one rounding to the output dtype.

Built through engine/layers/cpu_extension.py. Used by SdpaAttention for CPU decode rows
(plain decode and k+1-row verify runs) when its KernelOptions turn it on and the kernel
builds; otherwise the torch path runs and a warning says why (PDSERVE_CPU_ATTENTION_KERNEL=0,
read by engine/layers/kernel_options.py, skips the build).
Inputs: q [N, Hq, D] (N = B*rows; rows may be strided, as in a view into the fused qkv
output, each row's heads contiguous), the head-major cache [Hkv, blocks, block_size, D],
block tables [B, W] int32 and the KV length of each query row [N] int32 (row r belongs to
sequence r // rows).
"""

from __future__ import annotations

import torch

from engine.layers.cpu_extension import KernelFamily

EXTENSION = KernelFamily("CPU paged attention kernel")   # engine/csrc/cpu/paged_attention.cpp


def kernel():
    """The ops (torch.ops.pdserve), or None when they cannot be built here (reason logged once)."""
    return EXTENSION.load()


def fast_bf16_rows(dtype: torch.dtype, head_dim: int, groups: int) -> bool:
    """Whether rows of this shape take the kernel's AVX512-BF16 path: then prefill rows too
    are served one row at a time here, ~3x faster than torch's flash SDPA on CPU in bf16
    (SmolLM2, 8 prompts of 42-488 tokens, 30 layers: 512 -> 167 ms)."""
    mod = kernel()
    return (mod is not None and dtype == torch.bfloat16 and head_dim == 64
            and 1 <= groups <= 4 and mod.paged_bf16_d64_fast())


# the kernel's paths: "vector" (paged_attention.cpp: AVX512-BF16 dot products where the
# CPU has them, a generic loop elsewhere) and "amx" (paged_attention_amx.cpp: the scores
# on the AMX tiles); their codes in decode_layers' dims
DECODE_PATHS = ("vector", "amx")


def amx_fits(dtype: torch.dtype, head_dim: int, groups: int, block_size: int) -> bool:
    """Whether caches of this shape can take the "amx" path here: bf16, head_dim 64, 1-4
    query heads a KV head, blocks of a multiple of 16 keys, and the CPU, the build and the
    OS allowing the tiles."""
    mod = kernel()
    return (mod is not None and dtype == torch.bfloat16 and head_dim == 64
            and 1 <= groups <= 4 and block_size % 16 == 0 and mod.paged_amx_decode_available())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, rows: int,
                           scale: float, path: str = "vector") -> torch.Tensor:
    mod = kernel()
    if mod is None:
        raise RuntimeError(f"CPU paged attention kernel unavailable: {EXTENSION.failed}")
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()      # else a view into the fused qkv rows is read in place
    op = mod.paged_decode_attention_amx if path == "amx" else mod.paged_decode_attention
    return op(q, k_cache, v_cache, block_tables, kv_lens, rows, scale)

