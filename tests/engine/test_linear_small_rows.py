"""float32 linears over 2-4 rows (a speculative verify at batch 1) take F.linear or
(W @ x^T)^T by measurement on this machine (engine/layers/linear_choice.py
choose_small_rows): the choice follows the timings, each layer of a shape runs what was
chosen for its row count, and both forms give nn.Linear's product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import kernel_choice, kernel_select, linear_choice
from engine.layers.linear import SMALL_ROWS, Linear


def _model(layers: int = 3) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(Linear(40, 24, bias=True) for _ in range(layers))


def _injected(monkeypatch, tmp_path, seconds):
    """Time each candidate by `seconds(name, rows)` instead of the clock (each still runs
    once), with a fresh choice cache."""
    monkeypatch.setattr(kernel_choice, "CHOICES",
                        kernel_choice.ChoiceCache(tmp_path / "choices.json"))

    def fastest(what, candidates, timer=None):
        rows = int(what.split(" at ")[1].split()[0])
        times = {}
        for c in candidates:
            c.load()()
            times[c.name] = seconds(c.name, rows)
        return min(times, key=times.__getitem__), times
    monkeypatch.setattr(kernel_select, "fastest", fastest)


@pytest.mark.parametrize("winner_rows", [set(), {2}, {2, 3, 4}, {3, 4}])
def test_the_fastest_form_is_taken_per_row_count(monkeypatch, tmp_path, winner_rows):
    _injected(monkeypatch, tmp_path,
              lambda name, rows: (1.0 if (name == "w_xt") == (rows in winner_rows) else 2.0))
    model = _model()
    table = linear_choice.choose_small_rows(model)
    assert table == {f"f32 [24, 40] {r} rows": ("w_xt" if r in winner_rows else "f_linear")
                     for r in SMALL_ROWS}
    assert all(m.wxt_rows == frozenset(winner_rows) for m in model)


def test_the_choice_is_the_machines_and_other_dtypes_are_left_alone(monkeypatch, tmp_path):
    _injected(monkeypatch, tmp_path, lambda name, rows: 1.0 if name == "w_xt" else 2.0)
    first = linear_choice.choose_small_rows(_model())
    timed_again = []
    monkeypatch.setattr(linear_choice, "_measure_small",
                        lambda layers, rows: timed_again.append(rows) or "f_linear")
    assert linear_choice.choose_small_rows(_model()) == first    # kept, not re-timed
    assert not timed_again
    assert linear_choice.choose_small_rows(_model().bfloat16()) == {}


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("wxt", [frozenset(), frozenset(SMALL_ROWS)])
def test_both_forms_give_the_linear_product(rows, wxt):
    lin = _model(1)[0]
    lin.wxt_rows = wxt
    x = torch.randn(rows, 40)
    calls = []
    orig = torch.mm
    try:
        torch.mm = lambda a, b: calls.append(1) or orig(a, b)
        with torch.inference_mode():
            y = lin(x)
    finally:
        torch.mm = orig
    assert bool(calls) == (rows in wxt)
    assert y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
