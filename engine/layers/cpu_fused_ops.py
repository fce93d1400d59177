"""Fused CPU kernels for the decoder's small ops, in C++ (built by engine/layers/
cpu_extension.py; used by the layers whose KernelOptions has cpu_fused_ops on, see
engine/layers/kernel_options.py).

Why: at decode, a layer's matmuls see a few dozen rows, and the ops between them (norms,
residual adds, rotary, KV-cache writes, SiLU-and-mul) are ~30 torch ops a layer, each
paying dispatch and a pass over memory: ~900 per SmolLM2 decode step, a third of its
non-matmul time. Here most of them are four calls a layer:

- rope_:        rotary on q and k in place in the fused qkv output. Bit-identical to
                engine/layers/rotary.py (HF's rounding: cos/sin cast to the dtype,
                x*cos and rotate_half(x)*sin each rounded, then added).
- write_kv:     K and V rows into their cache slots (a copy: exact).
- add_rms_norm: residual + x (rounded to the dtype), then RMSNorm in float32 with HF's
                order (normalise, cast, times weight). bfloat16 only: its float32 sum of
                squares runs in another order than torch's, so the result can differ from
                the torch path in the last bit, which bfloat16's rounding nearly always
                absorbs; float32 keeps the torch path and stays bit-equal to HF.

Compiled with -ffp-contract=off: no fused multiply-adds, so every product and sum rounds
as torch's separate ops do. A call over at most PAR_ROWS (8) rows, as a small decode
batch's, runs on the calling thread; longer ones split their rows over torch's threads
with at::parallel_for. Each row is computed alone, so the split changes no bit.
Measured on a 2,048-token bf16 prefill step of SmolLM2, 2 threads: add_rms_norm 62 -> 34
ms, write_kv 38 -> 22 ms, rope_ 20 -> 11 ms (the step 1.378 -> 1.337 s). Decode batches
split too: in a decode step these calls are bound by reading rows the GEMMs just wrote
(the norm's input is half in the other core's cache) and by the cold KV slots, not by
arithmetic (33 us a norm at 32 rows in the step, 11 us on warm data), and the second
thread is still spinning from the GEMM before; batch 32 with ~230-token contexts, four
alternating pairs: 42.7-44.3 -> 41.1-43.0 ms a step.
"""

from __future__ import annotations

import torch

from engine.layers.cpu_extension import KernelFamily

EXTENSION = KernelFamily("CPU fused decoder ops")   # engine/csrc/cpu/fused_ops.cpp

# dtypes each op may take in the model: the exact ones for float32 and bfloat16, the norm
# (whose float32 result could differ from torch's in the last bit) for bfloat16 only
EXACT_DTYPES = (torch.float32, torch.bfloat16)
NEAR_DTYPES = (torch.bfloat16,)


def available() -> bool:
    """True when the extension is built (or loads from the cache) here. A layer asks once,
    at construction, when its KernelOptions turn the fused ops on."""
    return EXTENSION.load() is not None


def fits(x: torch.Tensor, dtypes: tuple) -> bool:
    """True when a fused op may serve `x`: CPU, a dtype it is used for, and no autograd
    (training runs the torch ops). The per-call check of a layer that has the ops."""
    return x.device.type == "cpu" and x.dtype in dtypes and not torch.is_grad_enabled()


def rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          heads: int, head_dim: int) -> None:
    EXTENSION.load().rope_(qkv, positions, cos, sin, heads, head_dim)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    EXTENSION.load().write_kv(k, v, k_cache, v_cache, slot_mapping)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a CPU [rows, n] float32 / bfloat16 tensor (same indices:
    the first maximum, a NaN above all numbers)."""
    return EXTENSION.load().argmax_rows(x)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(EXTENSION.load().add_rms_norm(x, residual, weight, eps))

