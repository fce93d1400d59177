"""bf16 linears take the weight-streaming GEMM or oneDNN by measurement on this machine
(engine/layers/linear_choice.py): a layer keeps its streaming copy exactly where the kept
choice took it, each row bucket runs the kernel chosen for it, and the choice is the
machine's (every engine of the same shapes takes the same one)."""

from __future__ import annotations

import pytest
import torch

from engine.layers import cpu_bf16_gemm, linear_choice
from engine.layers.linear import GEMM_SMALL_ROWS, Linear, can_pack, pack_linears
from tests.cpu_features import requires_avx512_bf16

pytestmark = [requires_avx512_bf16,
              pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"),
                                 reason="this CPU's oneDNN has no native bf16")]


def _model(layers: int = 3) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(Linear(128, 96, bias=True) for _ in range(layers)).bfloat16()


def test_copies_are_kept_where_the_choice_took_them_and_the_choice_is_kept():
    model = _model()
    pack_linears(model, bf16_gemm=True)
    table = linear_choice.choose(model)
    assert set(table) == {"gemm [96, 128] decode", "gemm [96, 128] prefill"}
    assert set(table.values()) <= {"bf16_gemm", "onednn"}
    for m in model:
        assert m.gemm_small == (table["gemm [96, 128] decode"] == "bf16_gemm")
        assert m.gemm_large == (table["gemm [96, 128] prefill"] == "bf16_gemm")
        assert (m.gemm_packed is not None) == (m.gemm_small or m.gemm_large)
    again = _model()
    pack_linears(again, bf16_gemm=True)
    assert linear_choice.choose(again) == table     # the machine's choice, not a re-timing


@torch.inference_mode()
def test_each_row_bucket_runs_the_kernel_chosen_for_it():
    model = _model(1)
    pack_linears(model, bf16_gemm=True)
    m = model[0]
    m.gemm_small, m.gemm_large = False, True
    for rows, streaming in ((1, False), (GEMM_SMALL_ROWS, False), (GEMM_SMALL_ROWS + 1, True)):
        x = torch.randn(rows, 128).bfloat16()
        onednn = torch.ops.mkldnn._linear_pointwise(x, m.packed, m.bias, "none", [], "")
        want = cpu_bf16_gemm.gemm(x, m.gemm_packed, m.bias) if streaming else onednn
        assert m.takes_bf16_gemm(x) == streaming and torch.equal(m(x), want), rows
