"""engine.layers.linear.Linear: the same product as nn.Linear on every path (rows 1-8,
bias or not, float32 and bfloat16), the same parameters and state_dict keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import SMALL_ROWS, Linear, can_pack, pack_linears


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_matches_nn_linear(rows, bias):
    torch.manual_seed(rows)
    lin = Linear(64, 96, bias=bias)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        y = lin(x)
    assert y.shape == (rows, 96) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_small_rows_path_is_taken_and_grad_path_is_plain():
    lin = Linear(8, 4)
    x = torch.randn(SMALL_ROWS[0], 8)
    calls = []
    orig = torch.mm
    try:
        torch.mm = lambda a, b: calls.append(1) or orig(a, b)
        with torch.inference_mode():
            lin(x)
        assert calls, "2-4 float32 rows on CPU should take the W @ x^T path"
        calls.clear()
        lin(x.requires_grad_()).sum().backward()      # training keeps F.linear
        assert not calls and lin.weight.grad is not None
    finally:
        torch.mm = orig


def test_bfloat16_and_state_dict_like_nn_linear():
    lin, ref = Linear(16, 8), nn.Linear(16, 8)
    assert lin.state_dict().keys() == ref.state_dict().keys()
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(lin.to(torch.bfloat16)(x), ref.to(torch.bfloat16)(x))


needs_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU's oneDNN has no native bf16 (AVX2 only)")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 200])
def test_packed_bf16_equals_f_linear(rows):
    torch.manual_seed(rows)
    lin = Linear(96, 160, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = F.linear(x, lin.weight, lin.bias)
        packed = Linear(96, 160, bias=True).to(torch.bfloat16)
        packed.load_state_dict(lin.state_dict())
        model = nn.Sequential(packed)
        assert pack_linears(model) == 1
        assert packed.packed is not None and packed.weight.numel() == 0
        y = packed(x)
        assert y.shape == ref.shape and y.dtype == torch.bfloat16
        # the same oneDNN kernel as F.linear's in bf16, minus the per-call reorder: the
        # same bits, so packing cannot change a greedy token
        assert torch.equal(y, ref)
        # a 3-d input and, with autograd on, the dense fallback from the packed copy
        torch.testing.assert_close(packed(x.view(1, rows, 96))[0], y, rtol=0, atol=0)
    with torch.enable_grad():
        assert torch.equal(packed(x), ref)
    # converted after load (the packed tensor is not): float32 input, float32 result
    packed.float()
    with torch.no_grad():
        y32 = packed(x.float())
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, F.linear(x.float(), lin.weight.float(), lin.bias.float()))


@needs_bf16
def test_pack_keeps_named_dense_weights_and_skips_float32():
    model = nn.ModuleDict({"proj": Linear(8, 8), "lm_head": Linear(8, 4)}).to(torch.bfloat16)
    assert pack_linears(model, keep_dense=("lm_head",)) == 2
    assert model["proj"].weight.numel() == 0 and model["lm_head"].weight.shape == (4, 8)
    assert not can_pack(torch.float32, torch.device("cpu"))
