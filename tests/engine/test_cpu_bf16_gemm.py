"""The weight-streaming bf16 GEMM (engine/layers/cpu_bf16_gemm.py) against an explicit float32
reference that sums in the kernel's order (k-pairs in turn, each pair's odd then even
product: VDPBF16PS), so the comparison is bit for bit; its silu(gate) * up form within
one bf16 rounding step of the exact value on those sums; rows do not depend on their
batch; and Linear and the MLP route bf16 rows to it only when
`pack_linears(bf16_gemm=True)` gave the layer a copy."""

from __future__ import annotations

import pytest
import torch

from engine.layers import cpu_bf16_gemm
from engine.layers.linear import Linear, can_pack, pack_linears
from tests.cpu_features import requires_avx512_bf16

# the kernel needs AVX512-BF16 (available exactly where the CPU has it:
# tests/engine/test_cpu_features.py)
pytestmark = requires_avx512_bf16


def _sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T as float32 sums in VDPBF16PS order: k-pairs in turn, each pair's odd then
    even product (bf16 x bf16 products are exact in float32)."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(x.shape[1] // 2):
        acc = acc + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
        acc = acc + xf[:, 2 * p, None] * wf[None, :, 2 * p]
    return acc


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The ordered sums, the bias added after them, one rounding to bf16."""
    acc = _sums(x, w)
    if bias is not None:
        acc = acc + bias.float()
    return acc.bfloat16()


@pytest.mark.parametrize("n,k", [(32, 2), (96, 64), (64, 160), (320, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_the_ordered_float32_sum(n, k, bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_bf16_gemm.pack(w)
    assert packed.shape == (n // 32, k // 2, 32, 2)
    for m in (1, 2, 7, 8, 9, 13, 16, 17, 33, 64, 203):
        x = torch.randn(m, k, generator=g).bfloat16()
        got = cpu_bf16_gemm.gemm(x, packed, b)
        assert torch.equal(got, _reference(x, w, b)), f"{m} rows of [{n}, {k}]"


def _within_one_rounding(got: torch.Tensor, exact: torch.Tensor) -> bool:
    """got (bf16) is exact (float64) rounded down or up: at most one bf16 step away; below
    float32's normal range (2^-126, where the kernel's float32 math flushes to zero) any
    value in it passes."""
    lo = exact.to(torch.bfloat16).double()
    step = (lo.abs() * 2.0 ** -7).clamp_min(2.0 ** -126)
    return bool(((got.double() - exact).abs() <= step).all())


@pytest.mark.parametrize("inter,k", [(16, 64), (48, 96), (1536, 576)])
def test_silu_mul_form_on_the_same_sums(inter, k):
    g = torch.Generator().manual_seed(inter + k)
    w = torch.randn(2 * inter, k, generator=g).bfloat16()
    packed = cpu_bf16_gemm.pack_silu_mul(w)
    assert packed.shape == (inter // 16, k // 2, 32, 2)
    for m in (1, 5, 8, 19, 64, 130):
        x = torch.randn(m, k, generator=g).bfloat16()
        got = cpu_bf16_gemm.gemm_silu_mul(x, packed)
        sums = _sums(x, w).double()
        gate, up = sums[:, :inter], sums[:, inter:]
        exact = gate * torch.sigmoid(gate) * up
        assert got.shape == (m, inter) and _within_one_rounding(got, exact), f"{m} rows"
        # most land on the correctly rounded value itself
        assert (got == exact.to(torch.bfloat16)).float().mean() > 0.9


@pytest.mark.parametrize("kernel", cpu_bf16_gemm.KERNELS)
def test_silu_mul_edges(kernel):
    """Gate values set exactly (K = 2, one-hot weights): 0, huge of both signs, NaN; on
    both kernels of the copy (tests/engine/test_cpu_bf16_gemm_brgemm.py has the rest of
    the brgemm kernel's tests)."""
    inter = 16
    w = torch.zeros(2 * inter, 2)
    w[:inter, 0] = 1.0                  # gate column j = x[:, 0]
    w[inter:, 1] = 1.0                  # up column j = x[:, 1]
    packed = cpu_bf16_gemm.pack_silu_mul(w.bfloat16())
    gates = [0.0, 1.0, -1.0, 80.0, -80.0, 1e30, -1e30, float("nan")]
    x = torch.tensor([[v, 2.0] for v in gates]).bfloat16()
    got = cpu_bf16_gemm.gemm_silu_mul(x, packed, kernel)[:, 0].float()
    gb = x[:, 0].double()
    want = (gb * torch.sigmoid(gb) * 2.0).to(torch.bfloat16).float()
    assert torch.equal(got[:7], want[:7]), (got, want)
    assert got[-1].isnan()


def test_rows_do_not_depend_on_their_batch_and_may_be_strided():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(128, 96, generator=g).bfloat16()
    packed = cpu_bf16_gemm.pack(w)
    wide = torch.randn(40, 100, generator=g).bfloat16()
    x = wide[:, 2:98]                 # rows 100 apart: a view into wider rows
    assert cpu_bf16_gemm.serves(x, packed)
    whole = cpu_bf16_gemm.gemm(x, packed)
    for lo, hi in [(0, 1), (3, 12), (11, 40)]:
        assert torch.equal(cpu_bf16_gemm.gemm(x[lo:hi], packed), whole[lo:hi])
    assert torch.equal(whole, cpu_bf16_gemm.gemm(x.contiguous(), packed))


def test_what_it_takes_and_clear_errors():
    w = torch.randn(64, 32).bfloat16()
    packed = cpu_bf16_gemm.pack(w)
    assert cpu_bf16_gemm.packable(w)
    assert not cpu_bf16_gemm.packable(torch.randn(48, 32).bfloat16())      # 48 columns
    assert not cpu_bf16_gemm.packable(torch.randn(64, 31).bfloat16())      # odd K
    assert not cpu_bf16_gemm.packable(torch.randn(64, 32))                 # float32
    ok = torch.randn(300, 32).bfloat16()
    assert cpu_bf16_gemm.serves(ok, packed)
    assert not cpu_bf16_gemm.serves(ok[:0], packed)
    assert not cpu_bf16_gemm.serves(ok.float(), packed)
    assert not cpu_bf16_gemm.serves(torch.randn(4, 64).bfloat16(), packed)  # other K
    assert not cpu_bf16_gemm.serves(torch.randn(4, 33).bfloat16()[:, 1:], packed)
    with pytest.raises(RuntimeError, match="bf16_gemm.pack"):
        cpu_bf16_gemm.gemm(ok, w)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_bf16_gemm.pack(torch.randn(48, 32).bfloat16())


@pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"), reason="no oneDNN bf16 here")
def test_mlp_gate_up_gets_the_silu_mul_form():
    torch.manual_seed(4)
    gate_up = Linear(64, 2 * 32, bias=False).bfloat16()
    gate_up.split_rows = 32
    w = gate_up.weight.detach().clone()
    pack_linears(torch.nn.ModuleDict({"gate_up": gate_up}), bf16_gemm=True)
    assert gate_up.gemm_silu_mul_packed is not None and gate_up.gemm_packed is None
    x = torch.randn(6, 64).bfloat16()
    with torch.no_grad():
        assert gate_up.takes_bf16_silu_mul(x)
        sums = _sums(x, w).double()
        got = cpu_bf16_gemm.gemm_silu_mul(x, gate_up.gemm_silu_mul_packed)
    assert _within_one_rounding(got, sums[:, :32] * torch.sigmoid(sums[:, :32]) * sums[:, 32:])


@pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"), reason="no oneDNN bf16 here")
def test_linear_takes_it_when_it_has_the_copy():
    torch.manual_seed(3)
    model = torch.nn.ModuleDict({"a": Linear(64, 96, bias=True), "b": Linear(64, 48),
                                 "head": Linear(64, 128)}).bfloat16()
    dense = {k: m.weight.detach().clone() for k, m in model.items()}
    bias = model["a"].bias.detach().clone()
    head_bias = model["head"].bias.detach().clone()
    pack_linears(model, keep_dense=("head",), bf16_gemm=True)
    assert model["a"].gemm_packed is not None
    assert model["b"].gemm_packed is None            # 48 columns: oneDNN only
    # kept dense (a tied head): copied too, its dense weight staying beside the copy
    assert model["head"].gemm_packed is not None
    assert torch.equal(model["head"].weight, dense["head"])
    with torch.no_grad():
        for m in (1, 5, 64, 257):
            x = torch.randn(m, 64).bfloat16()
            assert torch.equal(model["a"](x), _reference(x, dense["a"], bias))
            assert torch.equal(model["head"](x), _reference(x, dense["head"], head_bias))
        x = torch.randn(9, 64).bfloat16()          # no copy: oneDNN's packed weight
        onednn = torch.ops.mkldnn._linear_pointwise(x, model["b"].packed, model["b"].bias,
                                                    "none", [], "")
        assert not model["b"].takes_bf16_gemm(x)
        assert torch.equal(model["b"](x), onednn)
    x = torch.randn(4, 64).bfloat16()
    assert torch.is_grad_enabled() and not model["a"].takes_bf16_gemm(x)   # autograd: torch
