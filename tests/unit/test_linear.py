"""engine.layers.linear.Linear: the same product as nn.Linear on every path (rows 1-8,
bias or not, float32 and bfloat16), the same parameters and state_dict keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import SMALL_ROWS, Linear


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
