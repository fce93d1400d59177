"""MLA's absorbed decode on CPU: the C++ latent kernel or the torch einsums, chosen by
timing both where the model loads (as engine/layers/attention_choice.py does for prefill
attention), kept per machine by engine/layers/kernel_choice.py.

The kernel (engine/csrc/cpu/latent_attention.cpp) gathers each sequence's real rows and
runs two library GEMMs on them; the torch path pads every sequence to the batch's widest
block table and runs batched einsums. Measured on an AMX Xeon (R = 512, P = 64, bf16):
kernel / torch 0.41 for 8 x 1,024 tokens x 16 heads, 0.85 for 32 x 256, 0.46 for 1 x 4,096
x 128 heads; float32 0.58-1.02. Another CPU may differ, so it is measured, on a ragged
decode batch of the model's own heads and widths.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from engine.layers import cpu_extension, cpu_latent_attention, kernel_choice, kernel_select
from engine.models.mla import MlaAttention

log = logging.getLogger(__name__)

TIMED_LENS = (96, 200, 384, 640, 1024, 160, 512, 64)   # a ragged decode batch
PATHS = ("kernel", "torch")


def choose_decode(model: torch.nn.Module, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> str | None:
    """Set every MLA layer's decode path; the path, or None where there is no choice (not
    an MLA model, not a CPU, the kernel off or unbuildable, the expanded form forced)."""
    mods = [m for m in model.modules() if isinstance(m, MlaAttention)]
    if not mods:
        return None
    first = mods[0]
    probe = torch.empty(1, 1, block_size, first.dims.latent, dtype=dtype, device=device)
    if not (first.use_cpu_kernel and first.absorbed and cpu_latent_attention.usable(probe)):
        for m in mods:
            m.use_cpu_kernel = False
        return None
    d = first.dims
    key = (f"mla_decode [{first.num_heads} heads, {d.kv_lora_rank} + {d.rope}] "
           f"{str(dtype).removeprefix('torch.')} block {block_size} "
           f"{cpu_extension.KERNELS.build_name()}")
    name = kernel_choice.CHOICES.choose(key, lambda: _measure(first, block_size, dtype),
                                        still_valid=lambda kept: kept in PATHS)
    for m in mods:
        m.use_cpu_kernel = name == "kernel"
    log.info("MLA decode [%d heads, latent %d + %d] chosen by measurement: %s (of %s)",
             first.num_heads, d.kv_lora_rank, d.rope, name, ", ".join(PATHS))
    return name


def ragged_tables(lens, block_size: int) -> tuple[torch.Tensor, int]:
    """Block tables [B, W] int32 for sequences of these lengths, each its own consecutive
    blocks from block 1 (0 is the padding block), and the number of blocks used + 1."""
    widths = [-(-n // block_size) for n in lens]
    tables = torch.zeros(len(widths), max(widths), dtype=torch.int32)
    nxt = 1
    for i, w in enumerate(widths):
        tables[i, :w] = torch.arange(nxt, nxt + w)
        nxt += w
    return tables, nxt


@torch.inference_mode()
def _measure(attn: MlaAttention, bs: int, dtype: torch.dtype) -> str:
    d, hq = attn.dims, attn.num_heads
    gen = torch.Generator().manual_seed(0)
    tables, nxt = ragged_tables(TIMED_LENS, bs)
    cache = torch.randn(1, nxt, bs, d.latent, generator=gen).to(dtype)
    meta = SimpleNamespace(block_tables=tables,
                           seq_lens=torch.tensor(TIMED_LENS, dtype=torch.int32))
    n = len(TIMED_LENS)
    q_nope = torch.randn(n, hq, d.nope, generator=gen).to(dtype)
    q_pe = torch.randn(n, hq, d.rope, generator=gen).to(dtype)
    saved = attn.use_cpu_kernel

    def candidate(path: str) -> kernel_select.Candidate:
        def load():
            def call():
                attn.use_cpu_kernel = path == "kernel"
                return attn._decode(q_nope, q_pe, cache, meta, n)
            call()
            return call
        return kernel_select.Candidate(path, load)

    try:
        best, _ = kernel_select.fastest(f"MLA decode [{hq}, {d.kv_lora_rank} + {d.rope}]",
                                        [candidate(p) for p in PATHS])
    finally:
        attn.use_cpu_kernel = saved
    return best
