"""The brgemm kernel of the weight-streaming GEMM's packed copy (engine/csrc/cpu/
bf16_gemm_brgemm.cpp, `cpu_bf16_gemm.gemm(..., kernel="brgemm")`): within one bf16 rounding
of the exact product (it sums in float32 in its own order, so not bit for bit against a
fixed-order reference), bias after the sum, its silu(gate) * up form (its edges:
test_cpu_bf16_gemm.py), rows that do not depend on their batch (across its 64-row slices
too) nor on being views, and clear errors."""

from __future__ import annotations

import pytest
import torch

from engine.layers import cpu_bf16_gemm
from tests.cpu_features import requires_avx512_bf16

# the packed copies exist where AVX512-BF16 does, and there the micro-kernel runs
# (tests/engine/test_cpu_features.py)
pytestmark = requires_avx512_bf16


def _within_one_rounding(got: torch.Tensor, exact: torch.Tensor, x: torch.Tensor,
                         w: torch.Tensor) -> bool:
    """got (bf16) is at most one bf16 step from exact (float64) plus what float32 sums in
    any order may lose: K float32 roundings of the summands' magnitudes (matters only where
    the sum cancels to far below its terms)."""
    step = exact.to(torch.bfloat16).double().abs() * 2.0 ** -7
    sums = x.double().abs() @ w.double().abs().t() * x.shape[1] * 2.0 ** -24
    return bool(((got.double() - exact).abs() <= step + sums + 2.0 ** -126).all())


@pytest.mark.parametrize("n,k", [(32, 2), (96, 64), (64, 160), (320, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_within_one_rounding_of_the_exact_product(n, k, bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_bf16_gemm.pack(w)
    for m in (1, 2, 7, 16, 33, 64, 65, 130):
        x = torch.randn(m, k, generator=g).bfloat16()
        got = cpu_bf16_gemm.gemm(x, packed, b, "brgemm")
        exact = x.double() @ w.double().t() + (0 if b is None else b.double())
        assert got.shape == (m, n) and _within_one_rounding(got, exact, x, w), f"{m} rows"
        # and mostly the correctly rounded value itself
        assert (got == exact.to(torch.bfloat16)).float().mean() > 0.9


@pytest.mark.parametrize("inter,k", [(16, 64), (1536, 576)])
def test_silu_mul_form(inter, k):
    g = torch.Generator().manual_seed(inter + k)
    w = torch.randn(2 * inter, k, generator=g).bfloat16()
    packed = cpu_bf16_gemm.pack_silu_mul(w)
    for m in (1, 5, 64, 70):
        x = torch.randn(m, k, generator=g).bfloat16()
        got = cpu_bf16_gemm.gemm_silu_mul(x, packed, "brgemm")
        sums = x.double() @ w.double().t()
        gate, up = sums[:, :inter], sums[:, inter:]
        exact = gate * torch.sigmoid(gate) * up
        assert got.shape == (m, inter)
        # the sums' float32 error carries through silu and the product: two steps, and
        # what cancelling sums lose (scaled by the other factor)
        step = exact.to(torch.bfloat16).double().abs() * 2.0 ** -6
        err = x.double().abs() @ w.double().abs().t() * k * 2.0 ** -24
        carried = err[:, :inter] * up.abs() + err[:, inter:] * gate.abs()
        assert bool(((got.double() - exact).abs() <= step + 2 * carried + 1e-30).all()), \
            f"{m} rows"


def test_rows_do_not_depend_on_their_batch_and_may_be_strided():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(128, 96, generator=g).bfloat16()
    packed = cpu_bf16_gemm.pack(w)
    wide = torch.randn(150, 100, generator=g).bfloat16()
    x = wide[:, 2:98]                 # rows 100 apart: a view into wider rows
    whole = cpu_bf16_gemm.gemm(x, packed, None, "brgemm")
    for lo, hi in [(0, 1), (3, 12), (11, 40), (60, 150)]:   # across the 64-row slices
        assert torch.equal(cpu_bf16_gemm.gemm(x[lo:hi], packed, None, "brgemm"), whole[lo:hi])
    assert torch.equal(whole, cpu_bf16_gemm.gemm(x.contiguous(), packed, None, "brgemm"))


def test_clear_errors():
    w = torch.randn(64, 32).bfloat16()
    ok = torch.randn(3, 32).bfloat16()
    with pytest.raises(RuntimeError, match="bf16_gemm.pack"):
        cpu_bf16_gemm.gemm(ok, w, None, "brgemm")
    with pytest.raises(RuntimeError, match="bias"):
        cpu_bf16_gemm.gemm(ok, cpu_bf16_gemm.pack(w), torch.zeros(7).bfloat16(), "brgemm")
    with pytest.raises(RuntimeError, match=r"\[rows, K\]"):
        cpu_bf16_gemm.gemm(torch.randn(3, 30).bfloat16(), cpu_bf16_gemm.pack(w), None, "brgemm")
