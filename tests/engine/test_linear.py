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
    lin.wxt_rows = frozenset(SMALL_ROWS)            # as a measurement that chose it sets
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


@needs_bf16
@pytest.mark.parametrize("rows", [1, 15, 16, 64, 300])
def test_packed_mlp_runs_silu_and_mul_in_the_gemm_epilogues_from_16_rows(rows):
    """From FUSED_SILU_MUL_ROWS rows the MLP takes the two-GEMM path with SiLU and the
    product fused (one bf16 rounding, closer to float32); below it the fused gate/up GEMM
    and torch's silu * up, bit for bit."""
    from types import SimpleNamespace

    from engine.layers.linear import FUSED_SILU_MUL_ROWS, silu_mul_packed
    from engine.models.decoder import MLP
    torch.manual_seed(rows)
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="silu",
                          mlp_bias=False)
    mlp = MLP(cfg).to(torch.bfloat16)
    w = mlp.gate_up_proj.weight.detach().clone()
    wd = mlp.down_proj.weight.detach().clone()
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    assert pack_linears(mlp) == 2 and mlp.gate_up_proj.packed_halves is not None
    with torch.inference_mode():
        y = mlp(x)
        gate, up = F.linear(x, w).split(96, dim=-1)
        unfused = F.linear(F.silu(gate) * up, wd)
        exact = F.silu(x.float() @ w[:96].float().t()) * (x.float() @ w[96:].float().t())
        if rows < FUSED_SILU_MUL_ROWS:
            assert torch.equal(y, unfused)
        else:
            h = silu_mul_packed(x, *mlp.gate_up_proj.packed_halves)
            assert torch.equal(y, F.linear(h, wd))
            err = (h.float() - exact).norm() / exact.norm()
            assert err < 2 ** -8          # one bf16 rounding of the float32 product
            assert err <= ((F.silu(gate) * up).float() - exact).norm() / exact.norm()


@needs_bf16
def test_a_gate_up_with_bias_keeps_the_plain_path():
    from types import SimpleNamespace

    from engine.models.decoder import MLP
    cfg = SimpleNamespace(hidden_size=32, intermediate_size=48, hidden_act="silu",
                          mlp_bias=True)
    mlp = MLP(cfg).to(torch.bfloat16)
    pack_linears(mlp)
    assert mlp.gate_up_proj.packed is not None and mlp.gate_up_proj.packed_halves is None
    with torch.inference_mode():
        assert mlp(torch.randn(32, 32, dtype=torch.bfloat16)).shape == (32, 32)


@needs_bf16
def test_the_epilogue_silu_mul_switch_keeps_the_plain_path():
    from types import SimpleNamespace

    from engine.layers.kernel_options import KernelOptions
    from engine.models.decoder import MLP
    off = KernelOptions.from_env({"PDSERVE_CPU_EPILOGUE_SILU_MUL": "0"})
    assert not off.cpu_epilogue_silu_mul and KernelOptions.from_env({}).cpu_epilogue_silu_mul
    assert not KernelOptions().for_device("meta").cpu_epilogue_silu_mul
    cfg = SimpleNamespace(hidden_size=32, intermediate_size=48, hidden_act="silu",
                          mlp_bias=False)
    mlp = MLP(cfg, off).to(torch.bfloat16)
    pack_linears(mlp)
    assert mlp.gate_up_proj.packed is not None and mlp.gate_up_proj.packed_halves is None
