"""bf16 linears take the weight-streaming GEMM, its brgemm kernel or oneDNN by measurement
on this machine (engine/layers/linear_choice.py): a layer keeps its streaming copy exactly
where the kept choice took one of its kernels, each row bucket runs the kernel chosen for
it, injected timings pick the fastest of the three, and the choice is the machine's (every
engine of the same shapes takes the same one)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.layers import cpu_bf16_gemm, kernel_choice, kernel_select, linear_choice
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
    assert set(table.values()) <= {"bf16_gemm", "brgemm", "onednn"}
    for m in model:
        for kernel, bucket in ((m.gemm_small, "decode"), (m.gemm_large, "prefill")):
            chosen = table[f"gemm [96, 128] {bucket}"]
            assert kernel == (None if chosen == "onednn" else chosen)
        assert (m.gemm_packed is not None) == bool(m.gemm_small or m.gemm_large)
    again = _model()
    pack_linears(again, bf16_gemm=True)
    assert linear_choice.choose(again) == table     # the machine's choice, not a re-timing


@torch.inference_mode()
def test_each_row_bucket_runs_the_kernel_chosen_for_it(monkeypatch):
    model = _model(1)
    pack_linears(model, bf16_gemm=True)
    m = model[0]
    m.gemm_small, m.gemm_large = None, "bf16_gemm"
    for rows, streaming in ((1, False), (GEMM_SMALL_ROWS, False), (GEMM_SMALL_ROWS + 1, True)):
        x = torch.randn(rows, 128).bfloat16()
        onednn = torch.ops.mkldnn._linear_pointwise(x, m.packed, m.bias, "none", [], "")
        want = cpu_bf16_gemm.gemm(x, m.gemm_packed, m.bias) if streaming else onednn
        assert m.takes_bf16_gemm(x) == streaming and torch.equal(m(x), want), rows
    if cpu_bf16_gemm.brgemm_available():
        m.gemm_small = "brgemm"
        x = torch.randn(5, 128).bfloat16()
        want = cpu_bf16_gemm.gemm(x, m.gemm_packed, m.bias, "brgemm")
        kernels, real = [], cpu_bf16_gemm.gemm
        monkeypatch.setattr(cpu_bf16_gemm, "gemm", lambda *a: kernels.append(a[3]) or real(*a))
        assert torch.equal(m(x), want) and kernels == ["brgemm"]


@pytest.mark.parametrize("fastest", ["bf16_gemm", "brgemm", "onednn"])
def test_injected_timings_pick_the_fastest_of_the_three(fastest, tmp_path, monkeypatch):
    """The selector times every kernel on the layers' own weights (here: the timings are
    injected per kernel) and the layers take the fastest in each bucket (the brgemm kernel
    competes for decode-sized calls only); oneDNN winning both drops the copy."""
    monkeypatch.setattr(kernel_choice, "CHOICES", kernel_choice.ChoiceCache(tmp_path / "c.json"))
    seconds = {"bf16_gemm": 3.0, "brgemm": 2.0, "onednn": 2.5, fastest: 1.0}
    timed = []

    def timer(call):
        call()
        name = timer.current
        timed.append(name)
        return seconds[name]

    real_fastest = kernel_select.fastest

    def fastest_with_names(what, candidates, timer_=None):
        def named(c):
            def load():
                run = c.load()

                def call():
                    timer.current = c.name
                    return run()
                return call
            return kernel_select.Candidate(c.name, load)
        return real_fastest(what, [named(c) for c in candidates], timer)
    monkeypatch.setattr(kernel_select, "fastest", fastest_with_names)
    model = _model(2)
    pack_linears(model, bf16_gemm=True)
    table = linear_choice.choose(model)
    runs_here = {"bf16_gemm", "onednn"} | ({"brgemm"} if cpu_bf16_gemm.brgemm_available()
                                          else set())
    assert set(timed) == runs_here

    def pick(names):
        return fastest if fastest in names else min(names, key=seconds.get)
    # the brgemm kernel is a candidate for decode-sized calls only
    want = {"decode": pick(runs_here), "prefill": pick(runs_here - {"brgemm"})}
    assert table == {f"gemm [96, 128] {b}": k for b, k in want.items()}
    for m in model:
        kernels = [None if want[b] == "onednn" else want[b] for b in ("decode", "prefill")]
        assert [m.gemm_small, m.gemm_large] == kernels
        assert (m.gemm_packed is None) == (kernels == [None, None])


def test_a_kept_brgemm_choice_for_prefill_calls_is_measured_again(tmp_path, monkeypatch):
    """A choice kept by a build that still offered the brgemm kernel for prefill-sized
    calls is no longer one of that bucket's candidates: timed again, not trusted."""
    path = tmp_path / "c.json"
    monkeypatch.setattr(kernel_choice, "CHOICES", kernel_choice.ChoiceCache(path))
    pack_linears(model := _model(1), bf16_gemm=True)
    linear_choice.choose(model)
    kept = json.loads(path.read_text())
    prefill = [k for k in kept if " prefill " in k]
    assert len(prefill) == 1
    kept[prefill[0]] = "brgemm"
    path.write_text(json.dumps(kept))
    monkeypatch.setattr(kernel_choice, "CHOICES", kernel_choice.ChoiceCache(path))
    pack_linears(again := _model(1), bf16_gemm=True)
    assert linear_choice.choose(again)["gemm [96, 128] prefill"] in ("bf16_gemm", "onednn")
    assert json.loads(path.read_text())[prefill[0]] != "brgemm"


def test_the_choice_is_kept_apart_for_copies_on_huge_pages(tmp_path, monkeypatch):
    """Copies streamed from huge pages run faster than from the heap (the LM head's won
    there and lost on 4 KB pages): a choice made for one placement is not reused for the
    other, each is kept under its own key."""
    path = tmp_path / "c.json"
    monkeypatch.setattr(kernel_choice, "CHOICES", kernel_choice.ChoiceCache(path))
    pack_linears(model := _model(1), bf16_gemm=True)
    linear_choice.choose(model)
    heap = set(json.loads(path.read_text()))
    pack_linears(again := _model(1), bf16_gemm=True)
    linear_choice.choose(again, "huge pages")
    both = set(json.loads(path.read_text()))
    added = both - heap
    assert len(heap) == 2 and len(added) == 2           # decode and prefill, each placement
    assert all(k.endswith(" on huge pages") for k in added)
    assert not any(k.endswith(" on huge pages") for k in heap)
