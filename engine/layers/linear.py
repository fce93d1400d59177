"""Linear: nn.Linear with two CPU fast paths chosen at load.

- bfloat16 on CPU: weights prepacked once for oneDNN (`pack_linears`). torch's bf16
  `F.linear` hands a plain row-major weight to oneDNN, which reorders it into its
  blocked layout on every call; prepacked, a call only runs the kernel. Measured on an
  AVX512-bf16 EPYC, 2 threads, SmolLM2-135M's four layer shapes: 1 row 0.24 -> 0.13 ms,
  16 rows 0.52 -> 0.36, 48 rows 1.20 -> 1.05, 2048 rows 40.0 -> 35.2; the LM head
  (49,152 x 576) 4.3 -> 2.3 ms at 1 row and 11.8 -> 8.4 at 48. The numbers computed are
  the same oneDNN kernel's, so results match `F.linear` in bf16.
- float32 on CPU over 2-4 rows: torch's float32 linear (x @ W^T) over 1 row runs a gemv
  that streams W once, but over 2-4 rows it falls to a gemm path that costs 1.5-2.5x the
  one-row time, so a speculative verify of 2-4 rows (batch 1, k = 1-3) paid nearly k+1
  one-row forwards. Computed as (W @ x^T)^T the same product streams W once again
  (AVX512 EPYC, one thread, 30 layers of SmolLM2-135M: 2 rows 92 -> 50 ms, 4 rows
  88 -> 53 ms). float32 keeps MKL's `F.linear` otherwise: its rounding is HF's, which the
  greedy-exactness tests hold us to.

Same parameters and state_dict keys as nn.Linear (a packed layer whose dense weight was
released keeps an empty `weight`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

SMALL_ROWS = (2, 4)     # inclusive row range taking the float32 W @ x^T path
PACK_ROWS_HINT = 64     # the row count oneDNN picks its packed layout for (decode-sized)


class Linear(nn.Linear):
    # set per instance by the loader in batch-invariant mode (engine/layers/
    # batch_invariant.py): a row's result must not depend on how many rows share the
    # call, so no reroute, and every call padded to a multiple of `row_multiple` rows
    batch_invariant = False
    row_multiple = 1
    # the weight in oneDNN's blocked layout (`pack_linears`), or None
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is not None and x.dtype == packed.dtype and not torch.is_grad_enabled():
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        weight = self.weight
        if packed is not None and not weight.numel():
            # the dense copy was released: rebuild it, in x's dtype (a model converted
            # after load, e.g. .float() for training features, converts its parameters
            # but not the packed tensor)
            weight = packed.to_dense().to(x.dtype)
        if self.batch_invariant and x.dim() == 2:
            return padded_linear(x, weight, self.bias, self.row_multiple)
        if (x.dim() == 2 and SMALL_ROWS[0] <= x.shape[0] <= SMALL_ROWS[1]
                and x.dtype == torch.float32 and x.device.type == "cpu"
                and not torch.is_grad_enabled()):
            y = torch.mm(weight, x.t()).t()
            if self.bias is not None:
                y = y + self.bias
            return y.contiguous()
        return F.linear(x, weight, self.bias)


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
def pack_linears(model: nn.Module, keep_dense: tuple[str, ...] = (), release: bool = True
                 ) -> int:
    """Prepack every Linear of `model` for oneDNN and (with `release`) free its dense
    weight, except under the module names in `keep_dense` (a weight shared with another
    module, such as a head tied to the embedding, or one read directly). Returns the
    number of layers packed."""
    count = 0
    for name, m in model.named_modules():
        if not isinstance(m, Linear) or m.batch_invariant:
            continue
        m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_ROWS_HINT)
        count += 1
        kept = name in keep_dense or name.endswith(tuple("." + k for k in keep_dense))
        if release and not kept:
            m.weight.data = m.weight.data.new_empty(0)
    log.debug("prepacked %d linear layers for oneDNN", count)
    return count
