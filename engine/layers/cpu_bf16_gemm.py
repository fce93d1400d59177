"""bf16 linears that stream each weight block once, on AVX512-BF16 CPUs: the model's
layer GEMMs at every row count, in place of oneDNN's.

Why: a decode step reads every layer weight from memory (SmolLM2-135M: 240 MB, far more
than the L3) and at 1-64 rows does little work per byte, and oneDNN's kernels for those
shapes stall on the stream. With the weights coming from DRAM (30 layers' worth cycled,
as in a real step), SmolLM2's four layer GEMMs cost oneDNN 421 us a layer at 8 rows, 804
at 32 and 1,481 at 48 (its blocking changes at 43 rows and reads the weights twice); this
kernel 318 / 704 / 1,007 us (2 threads, AVX512-BF16 EPYC). Compute-bound prefill calls
come out level or slightly ahead too (1,024 rows 16.8 -> 16.3 ms a layer, 2,048 rows
33.8 -> 32.6), and with SiLU and the product in its epilogue a 32-prompt prefill ran 7%
faster, so it takes every row count.

How: the weight is packed once, at load, into 32-column blocks of k-pairs
([N/32, K/2, 32, 2]: each block one contiguous stream, software-prefetched 4 KB ahead).
The two threads take half the column blocks each; a block's columns go through groups
of up to 8 rows, each row's 32 outputs in two float32 accumulators fed by VDPBF16PS (the
row's k-pair broadcast against the block's 32 column pairs). Sums run over k-pairs in
order, so a row's result does not depend on which other rows share the call (oneDNN's
does: its K blocking varies with the row count); the output is rounded to bf16 once, at
the end, after an optional bias, as oneDNN rounds. A fused gate/up weight is packed as
16 gate + 16 up columns a block instead, and its kernel writes silu(gate) * up.

The same packed weights have a second kernel, "brgemm" (engine/csrc/cpu/
bf16_gemm_brgemm.cpp): each 32-column block is a VNNI matrix, so oneDNN's brgemm micro-kernel
multiplies it as it stands, on the AMX tiles where the CPU has them (an AMX Xeon, SmolLM2's
four layer GEMMs over 30 layers from memory: 9.4 / 10.0 / 12.0 / 20.6 ms at 1 / 16 / 32 / 64
rows against oneDNN's matmul 15.7 / 15.8 / 18.4 / 23.9 and this kernel 10.7 / 26.1 / 45.1 /
89.6). Which of the three a shape and row bucket takes is measured at load
(engine/layers/linear_choice.py).

Used by Linear and the MLP (engine/layers/linear.py, engine/models/decoder.py) and the
one-call decode layers (engine/layers/cpu_decode_layers.py) when the KernelOptions'
`cpu_bf16_gemm` is on (PDSERVE_CPU_BF16_GEMM=0 switches it off).
"""

from __future__ import annotations

import torch

from engine.layers.cpu_extension import KernelFamily

BLOCK_COLS = 32             # output columns per packed block
KERNELS = ("bf16_gemm", "brgemm")   # the kernels of the packed copy

EXTENSION = KernelFamily("CPU bf16 GEMM")   # engine/csrc/cpu/bf16_gemm.cpp


def available() -> bool:
    """True when the extension is built here and this CPU runs it (AVX512-BF16)."""
    module = EXTENSION.load()
    return module is not None and bool(module.bf16_gemm_supported())


def brgemm_available() -> bool:
    """True when the brgemm kernel runs here (oneDNN's micro-kernel passed its self-test)."""
    module = EXTENSION.load()
    return module is not None and bool(module.bf16_gemm_brgemm_available())


def packable(weight: torch.Tensor) -> bool:
    """Whether `pack` takes this weight: bf16 [N, K] with N a multiple of 32, K even."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.shape[0] % BLOCK_COLS == 0 and weight.shape[1] % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the [N/32, K/2, 32, 2] layout `gemm` streams."""
    return EXTENSION.load().bf16_gemm_pack(weight)


def pack_silu_mul(weight: torch.Tensor) -> torch.Tensor:
    """A fused gate/up weight [2 x inter, K], gate rows first -> the [inter/16, K/2, 32, 2]
    layout `gemm_silu_mul` streams (each block 16 gate columns and the same 16 of up).
    Takes what `packable` takes (2 x inter a multiple of 32)."""
    return EXTENSION.load().bf16_gemm_pack_silu_mul(weight)


def serves(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """A call `gemm` takes: bf16 rows (at least one) on CPU with the weight's K, unit
    column stride, each row starting on a 4-byte boundary."""
    return (x.dim() == 2 and x.shape[0] > 0 and x.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.stride(1) == 1 and x.stride(0) % 2 == 0
            and x.data_ptr() % 4 == 0 and x.shape[1] == 2 * packed.shape[1])


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
         kernel: str = "bf16_gemm") -> torch.Tensor:
    """x @ W^T (+ bias) in bf16 for a weight packed by `pack`, on `kernel` (of KERNELS)."""
    empty = x.new_empty(0) if bias is None else bias
    mod = EXTENSION.load()
    if kernel == "brgemm":
        return mod.bf16_gemm_brgemm(x, packed, empty)
    return mod.bf16_gemm(x, packed, empty)


def gemm_silu_mul(x: torch.Tensor, packed: torch.Tensor, kernel: str = "bf16_gemm"
                  ) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) in bf16, for a weight packed by `pack_silu_mul`: the
    sums in float32 as `gemm`'s, silu and the product on them, one rounding to bf16."""
    mod = EXTENSION.load()
    if kernel == "brgemm":
        return mod.bf16_gemm_brgemm_silu_mul(x, packed)
    return mod.bf16_gemm_silu_mul(x, packed)
