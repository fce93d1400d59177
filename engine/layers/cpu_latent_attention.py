"""MLA's absorbed decode on CPU as a C++ kernel (engine/csrc/cpu/latent_attention.cpp): the
latent cache's paged decode attention, one sequence at a time, its real rows gathered
through its block table and scored by library GEMMs, instead of padding every sequence to
the batch's widest table as engine/models/mla.py's torch path does (kept for other devices
and as the reference the kernel is tested against). Which of the two runs is chosen by
timing them where the model loads (mla.py's `choose_decode`).

Inputs: q_lat [N, H, R] (q_nope folded through W_UK), q_pe [N, H, P] (rotated), the latent
cache [1, blocks, block_size, R + P], block tables [B, W] int32, each query row's KV length
[N] int32 (row r belongs to sequence r // rows). Returns the attended latents [N, H, R];
W_UV is applied by the caller. Off with PDSERVE_CPU_ATTENTION_KERNEL=0, like the paged
kernel of the other attention (engine/layers/kernel_options.py).
"""

from __future__ import annotations

import torch

from engine.layers.cpu_extension import KernelFamily

EXTENSION = KernelFamily("CPU latent attention kernel")   # csrc/cpu/latent_attention.cpp
DTYPES = (torch.float32, torch.bfloat16)


def kernel():
    """The ops (torch.ops.pdserve), or None when they cannot be built here (reason logged once)."""
    return EXTENSION.load()


def usable(cache: torch.Tensor) -> bool:
    return cache.device.type == "cpu" and cache.dtype in DTYPES and kernel() is not None


def latent_decode_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                            block_tables: torch.Tensor, kv_lens: torch.Tensor, rows: int,
                            scale: float) -> torch.Tensor:
    mod = kernel()
    if mod is None:
        raise RuntimeError(f"CPU latent attention kernel unavailable: {EXTENSION.failed}")
    return mod.latent_decode_attention(q_lat, q_pe, cache, block_tables, kv_lens, rows, scale)
