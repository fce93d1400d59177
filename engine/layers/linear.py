"""Linear: nn.Linear with two CPU fast paths chosen at load.

- bfloat16 on CPU: weights prepacked once for oneDNN (`pack_linears`). torch's bf16
  `F.linear` hands a plain row-major weight to oneDNN, which reorders it into its
  blocked layout on every call; prepacked, a call only runs the kernel. Measured on an
  AVX512-bf16 EPYC, 2 threads, SmolLM2-135M's four layer shapes: 1 row 0.24 -> 0.13 ms,
  16 rows 0.52 -> 0.36, 48 rows 1.20 -> 1.05, 2048 rows 40.0 -> 35.2; the LM head
  (49,152 x 576) 4.3 -> 2.3 ms at 1 row and 11.8 -> 8.4 at 48. The numbers computed are
  the same oneDNN kernel's, so results match `F.linear` in bf16.
- float32 on CPU over 2-4 rows (a speculative verify at batch 1, k = 1-3): on an AVX512
  EPYC torch's float32 linear (x @ W^T) fell there to a gemm path costing 1.5-2.5x the
  one-row gemv, and (W @ x^T)^T streamed W once again (one thread, 30 layers of
  SmolLM2-135M: 2 rows 92 -> 50 ms, 4 rows 88 -> 53 ms). On an AMX Xeon it is the other way
  round: F.linear over 2-3 rows costs about one row's time and (W @ x^T)^T twice that, so
  the rule written for the EPYC made MTP at batch 1 slower than plain decoding (0.69x).
  Which rows take (W @ x^T)^T (`wxt_rows`) is chosen per shape by measurement at load
  (engine/layers/linear_choice.py `choose_small_rows`); none until then. float32 keeps
  MKL's `F.linear` otherwise: its rounding is HF's, which the greedy-exactness tests hold
  us to.

- bfloat16 on CPU, a fused gate/up projection (`split_rows` set by the MLP): its two halves
  are also prepacked on their own, so that the MLP's `silu(gate) * up` can run in the
  GEMMs' epilogues (`silu_mul_packed`) instead of two passes over a [rows, 2 x inter]
  tensor. Used from FUSED_SILU_MUL_ROWS rows on (below it the one fused GEMM's call is
  cheaper than two).

- bfloat16 on CPU with `pack_linears(bf16_gemm=True)`: a second packed copy streamed by
  engine/layers/cpu_bf16_gemm.py, which beats oneDNN's kernels when the weights come from
  DRAM (decode steps: 12-32% a layer, with 30 layers' weights cycled through) and keeps
  level at prefill sizes; a fused gate/up
  gets its silu(gate) * up form instead.

Same parameters and state_dict keys as nn.Linear (a packed layer whose dense weight was
released keeps an empty `weight`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import cpu_bf16_gemm

log = logging.getLogger(__name__)

SMALL_ROWS = (2, 3, 4)  # float32 row counts that may take (W @ x^T)^T, by measurement
PACK_ROWS_HINT = 64     # the row count oneDNN picks its packed layout for (decode-sized)
# From this many rows the MLP takes silu_mul_packed. SmolLM2's 30 MLPs (576 -> 2 x 1536),
# bf16, 2 threads, AVX512-BF16 EPYC, ms, one GEMM + silu + mul against two epilogue GEMMs:
# 1 row 2.03 / 2.43, 16 rows 5.57 / 5.52, 128 rows 33.7 / 32.8, 1,024 rows 270 / 261,
# 2,048 rows 602 / 528. Also closer to float32: relative error 0.0023 against 0.0035 (one
# bf16 rounding of silu(gate) * up instead of three).
FUSED_SILU_MUL_ROWS = 16
# the row bucket split of the measured kernel choice (engine/layers/linear_choice.py):
# decode steps' calls up to here, prefill chunks above
GEMM_SMALL_ROWS = 64


class Linear(nn.Linear):
    # set per instance by the loader in batch-invariant mode (engine/layers/
    # batch_invariant.py): the kernel `invariant(x, bias)` that gives a row the same bits
    # whatever rows share the call, and its name; every call goes through it
    invariant = None
    invariant_name: str | None = None
    # the weight in oneDNN's blocked layout (`pack_linears`), or None
    packed: torch.Tensor | None = None
    # a fused gate/up projection: the output row where up starts (set by the MLP), and
    # after `pack_linears` the two halves prepacked on their own
    split_rows: int | None = None
    packed_halves: tuple[torch.Tensor, torch.Tensor] | None = None
    # the weight in engine/layers/cpu_bf16_gemm.py's layout (`pack_linears`), or None;
    # a fused gate/up projection gets its silu(gate) * up layout instead
    gemm_packed: torch.Tensor | None = None
    gemm_silu_mul_packed: torch.Tensor | None = None
    # which kernel of that copy (cpu_bf16_gemm.KERNELS) each row bucket takes, None for
    # oneDNN, chosen by measurement at load (engine/layers/linear_choice.py): calls of up
    # to GEMM_SMALL_ROWS rows, longer ones
    gemm_small: str | None = "bf16_gemm"
    gemm_large: str | None = "bf16_gemm"
    # float32 on CPU: the row counts (of SMALL_ROWS) computed as (W @ x^T)^T, chosen by
    # measurement at load (linear_choice.choose_small_rows); F.linear for the others
    wxt_rows: frozenset[int] = frozenset()

    def takes_bf16_gemm(self, x: torch.Tensor) -> bool:
        """Whether a call over `x` runs engine/layers/cpu_bf16_gemm.py."""
        return _takes(x, self.gemm_packed) and self._bucket_takes(x)

    def takes_bf16_silu_mul(self, x: torch.Tensor) -> bool:
        """Whether the MLP's silu(gate) * up over `x` runs on cpu_bf16_gemm."""
        return _takes(x, self.gemm_silu_mul_packed) and self._bucket_takes(x)

    def _bucket_takes(self, x: torch.Tensor) -> bool:
        return self.copy_kernel(x) is not None

    def copy_kernel(self, x: torch.Tensor) -> str | None:
        """The kernel of the packed copy that a call over `x` takes (None: oneDNN)."""
        return self.gemm_small if x.shape[0] <= GEMM_SMALL_ROWS else self.gemm_large

    @property
    def batch_invariant(self) -> bool:
        return self.invariant is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:
            rows = x.reshape(-1, x.shape[-1])
            return self.invariant(rows, self.bias).reshape(*x.shape[:-1], -1)
        if self.takes_bf16_gemm(x):
            return cpu_bf16_gemm.gemm(x, self.gemm_packed, self.bias, self.copy_kernel(x))
        packed = self.packed
        if packed is not None and x.dtype == packed.dtype and not torch.is_grad_enabled():
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        weight = self.weight
        if packed is not None and not weight.numel():
            # the dense copy was released: rebuild it, in x's dtype (a model converted
            # after load, e.g. .float() for training features, converts its parameters
            # but not the packed tensor)
            weight = packed.to_dense().to(x.dtype)
        if (x.dim() == 2 and x.shape[0] in self.wxt_rows and x.dtype == torch.float32
                and x.device.type == "cpu" and not torch.is_grad_enabled()):
            return linear_wxt(x, weight, self.bias)
        return F.linear(x, weight, self.bias)


def linear_wxt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
    """x @ W^T + b computed as (W @ x^T)^T: one pass over W for a few rows of x."""
    y = torch.mm(weight, x.t()).t()
    if bias is not None:
        y = y + bias
    return y.contiguous()


def _takes(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    return (packed is not None and cpu_bf16_gemm.serves(x, packed)
            and not torch.is_grad_enabled())


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias, multiple: int) -> torch.Tensor:
    """F.linear over x's rows padded with zeros to a multiple of `multiple` rows."""
    n = x.shape[0]
    extra = -n % multiple
    if extra:
        x = torch.cat([x, x.new_zeros(extra, x.shape[1])])
    y = F.linear(x, weight, bias)
    return y[:n] if extra else y


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `pack_linears` applies: bf16 on a CPU whose oneDNN has native bf16."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@torch.no_grad()
def pack_linears(model: nn.Module, keep_dense: tuple[str, ...] = (), release: bool = True,
                 bf16_gemm: bool = False) -> int:
    """Prepack every Linear of `model` for oneDNN and (with `release`) free its dense
    weight, except under the module names in `keep_dense` (a weight shared with another
    module, such as a head tied to the embedding, or one read directly). With
    `bf16_gemm`, the Linears whose shapes it takes also get cpu_bf16_gemm's copy (the
    caller checked `cpu_bf16_gemm.available()`). Returns
    the number of layers packed."""
    count = 0
    for name, m in model.named_modules():
        if not isinstance(m, Linear) or m.batch_invariant:
            continue
        w = m.weight.detach()
        m.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        if m.split_rows is not None and m.bias is None:
            m.packed_halves = tuple(
                torch.ops.mkldnn._reorder_linear_weight(h.contiguous(), PACK_ROWS_HINT)
                for h in (w[:m.split_rows], w[m.split_rows:]))
        count += 1
        kept = name in keep_dense or name.endswith(tuple("." + k for k in keep_dense))
        # a kept layer gets its copy too (the LM head: 0.5-1 ms of a decode step on the
        # AMX Xeon against oneDNN's packed weight), its dense weight staying beside it
        if bf16_gemm and cpu_bf16_gemm.packable(w):
            if m.split_rows is not None and m.bias is None and 2 * m.split_rows == w.shape[0]:
                m.gemm_silu_mul_packed = cpu_bf16_gemm.pack_silu_mul(w)
            else:
                m.gemm_packed = cpu_bf16_gemm.pack(w)
        if release and not kept:
            m.weight.data = m.weight.data.new_empty(0)
    log.debug("prepacked %d linear layers for oneDNN", count)
    return count


def silu_mul_packed(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for prepacked bf16 halves: SiLU in the first GEMM's
    epilogue (oneDNN's swish, on the float32 accumulator) and the product in the second's,
    each rounded to bf16 once."""
    g = torch.ops.mkldnn._linear_pointwise(x, gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, g, up, None, "mul")
