"""Batch-invariant mode's fit to the matmul library (EngineConfig.batch_invariant).

The mode computes every row's attention one row at a time (engine/layers/sdpa_attention.py)
and keeps Linear on one code path (engine/layers/linear.py); what is left is the BLAS /
oneDNN kernel under F.linear, whose result for a row may change with the number of rows
in the call and the row's place in it (a gemv for one row, edge tiles for the rows past
the last full micro-tile). That is a property of the library on this CPU, so it is
measured here at load, on the model's own layers: the smallest row multiple that gives a
row the same bits wherever it sits becomes the layer's `row_multiple` (every call is
padded up to a multiple of it), so each row goes through the same micro-kernel. Measured
here (AVX2, torch 2.13): float32 differs between 1 row, 2-3 rows and 4+ rows, and
between a full 4-row tile and an edge row; on an AVX512-BF16 EPYC, oneDNN's bf16 1-row
and 8-row kernels round a few rows in a hundred differently (multiple 2 there). A
library with no such multiple gets a clear error, not a mode that silently is not one.
"""

from __future__ import annotations

import torch

from engine.layers.linear import Linear, padded_linear

# rows in a probe call, across the sizes where BLAS kernels switch (gemv, edge tiles,
# full micro-tiles)
SIZES = (*range(1, 18), 24, 31, 33, 64, 100)
ROW_MULTIPLES = (1, 2, 4, 8, 16, 32)


class NotBatchInvariant(RuntimeError):
    pass


def enable(model: torch.nn.Module) -> None:
    """Put every Linear of `model` on its batch-invariant path, its calls padded to the
    row multiple measured for its weight shape."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    gen = torch.Generator().manual_seed(0)
    multiple: dict[tuple, int] = {}
    for m in layers:
        m.batch_invariant = True
        key = (tuple(m.weight.shape), m.weight.dtype, m.weight.device)
        if key not in multiple:
            multiple[key] = measure_row_multiple(m.weight, gen)
        m.row_multiple = multiple[key]


@torch.inference_mode()
def measure_row_multiple(weight: torch.Tensor, gen: torch.Generator) -> int:
    """The smallest row multiple that gives a row the same bits wherever it sits in a call
    of any size. Every row of every probe call is checked against the same row computed
    alone: a different summation order shows in a bf16 output only when it moves the
    rounding (a few rows in a hundred), so one probe row per call can miss it (it did on
    an AVX512-BF16 CPU, where oneDNN's 1-row and 8-row kernels differ)."""
    sizes = SIZES
    pool = torch.randn(sizes[-1] * 2, weight.shape[1], generator=gen).to(weight.device,
                                                                          weight.dtype)
    for multiple in ROW_MULTIPLES:
        alone = torch.stack([padded_linear(pool[i:i + 1], weight, None, multiple)[0]
                             for i in range(pool.shape[0])])
        # each size starts at its own offset, so a pool row sits at many positions
        if all(torch.equal(padded_linear(pool[o:o + n], weight, None, multiple),
                           alone[o:o + n])
               for n in sizes for o in (n % sizes[-1], sizes[-1] - n)):
            return multiple
    raise NotBatchInvariant(
        f"batch_invariant: this CPU's {weight.dtype} matmul gives a row different bits "
        f"depending on the rows beside it (weight {list(weight.shape)}), whatever row "
        f"multiple up to {ROW_MULTIPLES[-1]} the calls are padded to; run without "
        f"batch_invariant")
