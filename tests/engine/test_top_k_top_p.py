"""The CPU top-k / top-p mask from candidates (engine/top_k_top_p.py) keeps exactly the
tokens the sorted definition keeps: per-row k and p, ties at the cut (broken toward the
lower id), rows that keep everything, and rows whose cut lies past the candidates (decided
again from more candidates, then by the full sort). So does the C++ kernel that decides a
row from its likely tokens (engine/csrc/cpu/top_k_top_p.cpp), the rows it leaves undecided
included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import engine.top_k_top_p as tkp


def _near_the_cut(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> bool:
    """Whether a row's cumulative mass lands within float32 rounding of p - eps at some
    position: there the kept set is decided by rounding in either implementation."""
    v = logits.shape[-1]
    vals = logits.double().sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k, v).clamp(max=v)
    for row in range(logits.shape[0]):
        if top_p[row] >= 1.0:
            continue
        probs = torch.softmax(vals[row, :int(k[row])], -1)
        before = probs.cumsum(-1) - probs
        if ((before - (float(top_p[row]) - tkp.TOP_P_EPS)).abs() < 1e-5).any():
            return True
    return False


@st.composite
def batches(draw):
    v = draw(st.integers(20, 160))
    n = draw(st.integers(1, 6))
    # few distinct levels make ties common, as bf16 logits do
    levels = draw(st.integers(2, 40))
    scale = draw(st.sampled_from([0.05, 0.5, 2.0, 8.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (n, v), generator=g).float() * scale / levels * 10
    top_k = torch.tensor(draw(st.lists(st.sampled_from([-1, 1, 2, 5, 9, 17, 40, 100, 500]),
                                       min_size=n, max_size=n)))
    top_p = torch.tensor(draw(st.lists(st.sampled_from([1.0, 0.999, 0.95, 0.9, 0.7, 0.5,
                                                        0.2, 0.01]),
                                       min_size=n, max_size=n)), dtype=torch.float32)
    return logits, top_k, top_p


@settings(max_examples=300, deadline=None)
@given(batch=batches(), widths=st.sampled_from([(4, 16), (8, 32), (16, 64), (2, 3)]),
       use_k=st.booleans(), use_p=st.booleans())
def test_candidates_keep_what_the_sort_keeps(batch, widths, use_k, use_p):
    logits, top_k, top_p = batch
    k, p = (top_k if use_k else None), (top_p if use_p else None)
    # the cut the call makes: a row's k is off when top_k is not passed (checking the
    # drawn k there let a tie at the cut of a k-less row through, decided by rounding)
    assume(not _near_the_cut(logits, top_k if use_k else torch.full_like(top_k, -1),
                             top_p if use_p else torch.ones_like(top_p)))
    want = tkp.top_k_top_p_sorted(logits, k, p)
    with pytest.MonkeyPatch.context() as mp:    # small widths, undone for the next test
        mp.setattr(tkp, "CANDIDATES", widths)
        got = tkp._by_candidates(logits, k, p, 0)
    assert torch.equal(got, want)


@settings(max_examples=300, deadline=None)
@given(batch=batches(), use_k=st.booleans(), use_p=st.booleans(),
       odd=st.sampled_from([None, float("-inf"), float("inf"), float("nan")]))
def test_likely_tokens_keep_what_the_sort_keeps(batch, use_k, use_p, odd):
    logits, top_k, top_p = batch
    if odd is not None:         # a row the kernel leaves to the general path
        logits[0, 3] = odd
    k, p = (top_k if use_k else None), (top_p if use_p else None)
    assume(not _near_the_cut(logits.nan_to_num(), top_k if use_k
                             else torch.full_like(top_k, -1),
                             top_p if use_p else torch.ones_like(top_p)))
    want = tkp.top_k_top_p_sorted(logits, k, p)
    got = tkp._by_likely_tokens(logits, k, p)
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("case", ["peaked", "flat_p_near_one", "top_k_past_1024",
                                  "top_k_past_8192", "mixed", "tail_past_the_thresholds"])
def test_full_vocabulary_rows_match_the_sort(case):
    v, g = 49_152, torch.Generator().manual_seed(7)
    logits = torch.randn(8, v, generator=g)
    top_k = torch.full((8,), -1)
    top_p = torch.full((8,), 0.9)
    if case == "peaked":
        logits = logits * 6
    elif case == "flat_p_near_one":      # the cut lies past both candidate widths
        logits, top_p = logits * 0.01, torch.full((8,), 0.999)
    elif case == "top_k_past_1024":
        top_k = torch.full((8,), 5000)
    elif case == "top_k_past_8192":
        top_k, top_p = torch.full((8,), 20_000), torch.full((8,), 1.0)
    elif case == "tail_past_the_thresholds":
        # one dominant token; the other 49,151 each under the kernel's last threshold
        # (1e-9) but together 1e-5 of the mass, which p = 0.999999 needs: undecided there
        logits = torch.full((8, v), -23.0) + logits * 0.01
        logits[:, 17] = 0.0
        top_p = torch.full((8,), 0.999999)
    else:
        logits = logits.to(torch.bfloat16).float() * 3     # ties
        top_k = torch.tensor([-1, 1, 50, 5000, -1, 30_000, 7, -1])
        top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 0.99, 0.1, 0.3])
    assert tkp.CANDIDATES == (1024, 8192)
    want = tkp.top_k_top_p_sorted(logits, top_k, top_p)
    got = tkp.apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(got, want)
    assert (got.isfinite().sum(-1) >= 1).all()
