"""RMSNorm's fused form equals HF's spelled-out numerics bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.layers.norm import RMSNorm


def _hf(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (300, 576), (32, 1000)])
def test_rms_norm_equals_hf_bitwise(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    norm = RMSNorm(dim, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
    got = norm(x)
    assert got.dtype == dtype
    assert torch.equal(got, _hf(x, norm.weight, 1e-6))
    # the comparison can fail: another eps shows
    assert not torch.equal(got, _hf(x, norm.weight, 1e-1))
