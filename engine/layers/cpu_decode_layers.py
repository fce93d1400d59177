"""A decode step's decoder layers in one C++ call (CPU, bfloat16, prepacked linears).

Why: a SmolLM2 decode step runs 30 layers of ~10 kernel calls each, and from Python each
call pays its own way in: a module's __call__, the checks of the layer's fast paths,
pybind's argument parsing, torch.ops' boxed dispatch (~3 us a GEMM). At batch 1-32 that
was 4-5 ms a step (10-20% of it). Here one call runs every layer, making the same kernel
calls in the same order with the same arguments: the oneDNN GEMMs through torch's typed
dispatcher (mkldnn::_linear_pointwise and its .binary epilogue), the fused ops, the paged
attention and the bf16 GEMM as the C++ functions engine/csrc/cpu/ops.h declares (one
extension holds them all, so both paths run one build of each kernel). The result is
bit-identical to the Python layers' (tests/engine/test_cpu_decode_layers.py).

Serves decode-only forwards whose attention runs on the C++ paged kernel (plain decode
rows or k+1-row verify runs); prefill steps keep the Python layers, where the GEMMs
dominate. Used by DecoderForCausalLM when its KernelOptions turn `cpu_decode_layers` on
and every piece is there (engine/models/decoder.py `DecoderForCausalLM.decode_layers`);
PDSERVE_CPU_DECODE_LAYERS=0 switches it off.

Per layer, `weights` holds 13 tensors: input norm weight, packed qkv, qkv bias (an empty
tensor when none), packed o_proj, post-attention norm weight, packed gate half, packed up
half (both empty when the MLP's epilogue path is off), packed gate/up, packed down, then
the copies engine/layers/cpu_bf16_gemm.py streams of qkv, o_proj, gate/up (its
silu(gate) * up layout) and down (empty when the model has none). A linear with a copy
runs on it, as Linear.forward and the MLP do.
"""

from __future__ import annotations

import torch

from engine.layers import cpu_paged_attention
from engine.layers.cpu_extension import KernelFamily

TENSORS_PER_LAYER = 13

EXTENSION = KernelFamily("CPU decode layers")   # engine/csrc/cpu/decode_layers.cpp


def available() -> bool:
    """True when the CPU extension is built here (it holds the kernels this one calls)."""
    return EXTENSION.load() is not None and cpu_paged_attention.kernel() is not None


def decode_layers(x: torch.Tensor, weights: list[torch.Tensor], k_caches: list[torch.Tensor],
                  v_caches: list[torch.Tensor], positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                  kv_lens: torch.Tensor, dims: list[int], eps: float,
                  scale: float, aux_layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """[x, residual, aux streams...] after every layer; `dims` = [rows, Hq, Hkv, head_dim,
    intermediate, rows from which the MLP takes the GEMM epilogues, the kernel of the qkv,
    o, gate/up and down linears (0 oneDNN, 1 cpu_bf16_gemm's VDPBF16PS copy, 2 its brgemm
    copy), the paged attention's path (its index in cpu_paged_attention.DECODE_PATHS)]."""
    return EXTENSION.load().decode_layers(x, weights, k_caches, v_caches, positions, cos, sin,
                                          slot_mapping, block_tables, kv_lens, dims,
                                          eps, scale, list(aux_layers))
