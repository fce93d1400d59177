"""The small-batch bf16 GEMM (engine/layers/cpu_small_gemm.py) against an explicit float32
reference that sums in the kernel's order (k-pairs in turn, each pair's odd then even
product: VDPBF16PS), so the comparison is bit for bit; rows do not depend on their batch;
and Linear routes 1-64 bf16 rows to it only when `pack_linears(small_gemm=True)` gave
the layer a copy."""

from __future__ import annotations

import pytest
import torch

from engine.layers import cpu_small_gemm
from engine.layers.cpu_small_gemm import SMALL_GEMM_ROWS
from engine.layers.linear import Linear, can_pack, pack_linears


@pytest.fixture(scope="module", autouse=True)
def usable():
    if not cpu_small_gemm.available():
        # the kernel needs AVX512-BF16; CI's machine and this one have it
        pytest.fail(f"small GEMM unusable here: {cpu_small_gemm.EXTENSION.failed}")


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 sums in VDPBF16PS order (bf16 x bf16 products are exact in float32), the
    bias added after the sum, one rounding to bf16."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(x.shape[1] // 2):
        acc = acc + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
        acc = acc + xf[:, 2 * p, None] * wf[None, :, 2 * p]
    if bias is not None:
        acc = acc + bias.float()
    return acc.bfloat16()


@pytest.mark.parametrize("n,k", [(32, 2), (96, 64), (64, 160), (320, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_the_ordered_float32_sum(n, k, bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_small_gemm.pack(w)
    assert packed.shape == (n // 32, k // 2, 32, 2)
    for m in (1, 2, 7, 8, 9, 13, 16, 17, 33, SMALL_GEMM_ROWS):
        x = torch.randn(m, k, generator=g).bfloat16()
        got = cpu_small_gemm.gemm(x, packed, b)
        assert torch.equal(got, _reference(x, w, b)), f"{m} rows of [{n}, {k}]"


def test_rows_do_not_depend_on_their_batch_and_may_be_strided():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(128, 96, generator=g).bfloat16()
    packed = cpu_small_gemm.pack(w)
    wide = torch.randn(40, 100, generator=g).bfloat16()
    x = wide[:, 2:98]                 # rows 100 apart: a view into wider rows
    assert cpu_small_gemm.serves(x, packed)
    whole = cpu_small_gemm.gemm(x, packed)
    for lo, hi in [(0, 1), (3, 12), (11, 40)]:
        assert torch.equal(cpu_small_gemm.gemm(x[lo:hi], packed), whole[lo:hi])
    assert torch.equal(whole, cpu_small_gemm.gemm(x.contiguous(), packed))


def test_what_it_takes_and_clear_errors():
    w = torch.randn(64, 32).bfloat16()
    packed = cpu_small_gemm.pack(w)
    assert cpu_small_gemm.packable(w)
    assert not cpu_small_gemm.packable(torch.randn(48, 32).bfloat16())      # 48 columns
    assert not cpu_small_gemm.packable(torch.randn(64, 31).bfloat16())      # odd K
    assert not cpu_small_gemm.packable(torch.randn(64, 32))                 # float32
    ok = torch.randn(SMALL_GEMM_ROWS, 32).bfloat16()
    assert cpu_small_gemm.serves(ok, packed)
    assert not cpu_small_gemm.serves(torch.randn(SMALL_GEMM_ROWS + 1, 32).bfloat16(), packed)
    assert not cpu_small_gemm.serves(ok[:0], packed)
    assert not cpu_small_gemm.serves(ok.float(), packed)
    assert not cpu_small_gemm.serves(torch.randn(4, 64).bfloat16(), packed)  # other K
    assert not cpu_small_gemm.serves(torch.randn(4, 33).bfloat16()[:, 1:], packed)
    with pytest.raises(RuntimeError, match="small_gemm.pack"):
        cpu_small_gemm.gemm(ok, w)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_small_gemm.pack(torch.randn(48, 32).bfloat16())


@pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"), reason="no oneDNN bf16 here")
def test_linear_takes_it_for_decode_sized_batches_only():
    torch.manual_seed(3)
    model = torch.nn.ModuleDict({"a": Linear(64, 96, bias=True), "b": Linear(64, 48),
                                 "head": Linear(64, 128)}).bfloat16()
    dense = {k: m.weight.detach().clone() for k, m in model.items()}
    bias = model["a"].bias.detach().clone()
    pack_linears(model, keep_dense=("head",), small_gemm=True)
    assert model["a"].small_packed is not None
    assert model["b"].small_packed is None            # 48 columns: oneDNN only
    assert model["head"].small_packed is None         # kept dense: never copied
    with torch.no_grad():
        for m in (1, 5, SMALL_GEMM_ROWS):
            x = torch.randn(m, 64).bfloat16()
            assert torch.equal(model["a"](x), _reference(x, dense["a"], bias))
        x = torch.randn(SMALL_GEMM_ROWS + 1, 64).bfloat16()
        onednn = torch.ops.mkldnn._linear_pointwise(x, model["a"].packed, model["a"].bias,
                                                    "none", [], "")
        assert not model["a"].takes_small_gemm(x)
        assert torch.equal(model["a"](x), onednn)
    x = torch.randn(4, 64).bfloat16()
    assert torch.is_grad_enabled() and not model["a"].takes_small_gemm(x)   # autograd: torch
