"""A linear whose every output is summed over k in order, in float32, on any CPU: the
fallback of batch-invariant mode (engine/layers/batch_invariant.py) where the
weight-streaming bf16 GEMM does not run (no AVX512-BF16, or a weight shape it does not
take) and the BLAS library gives a row different bits beside other rows.

The source is engine/csrc/cpu/fixed_order_linear.cpp (why it holds by construction is
written there), compiled into the one CPU extension (engine/layers/cpu_extension.py) with
-ffp-contract=off so no multiply-add is fused on one code path and not another.
Plain C++ the compiler vectorizes: slower than oneDNN, the price of a row's bits never
depending on its batch.
"""

from __future__ import annotations

import torch

from engine.layers.cpu_extension import KernelFamily

EXTENSION = KernelFamily("CPU fixed-order linear")   # engine/csrc/cpu/fixed_order_linear.cpp


def available() -> bool:
    return EXTENSION.load() is not None


def prepare(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the [K, N] layout `linear` reads."""
    return weight.detach().t().contiguous()


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) for float32 or bf16 rows and a `prepare`d weight."""
    empty = x.new_empty(0) if bias is None else bias
    return EXTENSION.load().fixed_order_linear(x.contiguous(), weight_t, empty)
