"""Sampler + SamplingMetadata: exact masks, statistical sampling, seeds, penalties, logprobs.

References are computed independently here (python loops / hand-built numbers), never by
calling the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import Sampler, apply_penalties, sample_from_probs, token_at
from engine.sampling_metadata import SamplingMetadata
from engine.sampling_params import SamplingParams

SAMPLER = Sampler()


def meta_for(params, vocab, prompts=None, outputs=None, gens=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, prompts or [[]] * n, outputs or [[]] * n,
                                  gens or [None] * n, vocab)


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi2(df), in closed form: Q(df/2, x/2) via Q(a+1, z) = Q(a, z) +
    z^a e^-z / Gamma(a+1), from Q(1/2, z) = erfc(sqrt z) or Q(1, z) = e^-z."""
    z = x / 2.0
    a = 0.5 if df % 2 else 1.0
    q = math.erfc(math.sqrt(z)) if df % 2 else math.exp(-z)
    term = z**a * math.exp(-z) / math.gamma(a + 1)
    while a < df / 2.0:
        q += term
        a += 1.0
        term *= z / a
    return q


def chi2_stat(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    exp = expected_p.double() * counts.sum()
    return float(((counts.double() - exp) ** 2 / exp).sum())


def test_chi2_sf_matches_known_critical_values():
    # Tabulated: chi2(7) upper 1e-4 point ~ 29.877; chi2(1) at 3.841 -> 0.05.
    assert chi2_sf(29.877, 7) == pytest.approx(1e-4, rel=1e-3)
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-4)
    assert chi2_sf(10.0, 2) == pytest.approx(math.exp(-5.0), rel=1e-9)  # df=2: sf = e^(-x/2)
    assert chi2_sf(0.5, 7) == pytest.approx(0.999446, rel=1e-5)  # series branch
    assert chi2_sf(5000.0, 7) < 1e-300


def test_greedy_equals_argmax_first_index_on_ties():
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    logits[3, 7] = logits[3, 9] = 100.0  # tie: torch.argmax (and HF) take the first index
    out = SAMPLER(logits, meta_for([SamplingParams(temperature=0.0)] * 16, 50))
    assert torch.equal(out.next_tokens, logits.argmax(dim=-1))
    assert out.next_tokens[3] == 7
    assert out.logprobs is None and out.probs is None


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(2, 300), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       ties=st.integers(0, 3), nan_row=st.booleans())
def test_greedy_on_half_logits_equals_argmax_of_their_float32_copy(rows, vocab, seed, dtype,
                                                                   ties, nan_row):
    """A plain greedy batch takes the argmax of the logits as they come (bf16 from a bf16
    model), without the float32 copy: the same index in every case, ties (the first) and
    NaNs (above every number) included, with the C++ argmax and with torch's."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 4).round().to(dtype)   # many ties
    for _ in range(ties):
        r, c = torch.randint(rows, (1,), generator=g), torch.randint(vocab, (1,), generator=g)
        logits[r, c] = logits[r].max()
    if nan_row:
        logits[rows // 2, vocab // 3] = float("nan")
    expected = logits.float().argmax(dim=-1)
    meta = meta_for([SamplingParams(temperature=0.0)] * rows, vocab)
    for sampler in (SAMPLER, Sampler(cpu_argmax=True)):
        out = sampler(logits, meta)
        assert torch.equal(out.next_tokens, expected)
        assert out.logprobs is None and out.probs is None


def test_mixed_batch_greedy_rows_exact():
    torch.manual_seed(1)
    n, v = 64, 40
    logits = torch.randn(n, v) * 0.1  # flat: random rows almost never pick the argmax
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, top_k=5 if i % 4 else -1)
              for i in range(n)]
    meta = meta_for(params, v)
    assert not meta.all_greedy and not meta.all_random
    out = SAMPLER(logits, meta, return_probs=True)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(out.next_tokens[0::2], argmax[0::2])
    assert not torch.equal(out.next_tokens[1::2], argmax[1::2])
    assert torch.equal(out.probs[0::2], torch.nn.functional.one_hot(argmax[0::2], v).float())


def _sample_counts(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    v = logits_row.numel()
    out = SAMPLER(logits_row.expand(n, v).contiguous(), meta_for([params] * n, v))
    return torch.bincount(out.next_tokens, minlength=v)


def test_random_sampling_matches_softmax_over_temperature():
    torch.manual_seed(2)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 1.2])
    t = 0.7
    counts = _sample_counts(logits, SamplingParams(temperature=t), 50_000)
    expected = torch.softmax(logits.double() / t, dim=-1)
    assert chi2_sf(chi2_stat(counts, expected), df=7) > 1e-4
    # The same check must reject a wrong distribution (here: temperature ignored).
    wrong = torch.softmax(logits.double(), dim=-1)
    assert chi2_sf(chi2_stat(counts, wrong), df=7) < 1e-4


def test_top_k_exact_support_and_renormalised_probs():
    torch.manual_seed(3)
    v, k, t = 12, 3, 0.8
    logits = torch.randn(v)
    top = sorted(range(v), key=lambda i: -float(logits[i]))[:k]
    ref = torch.zeros(v, dtype=torch.float64)
    z = sum(math.exp(float(logits[i]) / t) for i in top)
    for i in top:
        ref[i] = math.exp(float(logits[i]) / t) / z
    n = 20_000
    meta = meta_for([SamplingParams(temperature=t, top_k=k)] * n, v)
    out = SAMPLER(logits.expand(n, v).contiguous(), meta, return_probs=True)
    assert set(out.next_tokens.tolist()) == set(top)
    torch.testing.assert_close(out.probs[0].double(), ref, rtol=1e-5, atol=1e-7)
    counts = torch.bincount(out.next_tokens, minlength=v)[top]
    assert chi2_sf(chi2_stat(counts, ref[top]), df=k - 1) > 1e-4


def test_top_k_per_row_and_disabled_row_in_same_batch():
    torch.manual_seed(4)
    v = 10
    logits = torch.randn(3, v)
    params = [SamplingParams(top_k=1), SamplingParams(top_k=4), SamplingParams(top_k=-1)]
    out = SAMPLER(logits, meta_for(params, v), return_probs=True)
    support = (out.probs > 0).sum(dim=-1).tolist()
    assert support == [1, 4, v]
    assert out.next_tokens[0] == logits[0].argmax()


HAND = [0.5, 0.3, 0.15, 0.05]


def _hand_probs(perm: list[int], **kw) -> torch.Tensor:
    """Sampler probs for HAND placed at token ids `perm`, so the scatter-back is exercised."""
    logits = torch.full((len(perm),), -1.0)
    for p, tok in zip(HAND, perm, strict=True):
        logits[tok] = math.log(p)
    return SAMPLER(logits[None], meta_for([SamplingParams(**kw)], len(perm)),
                   return_probs=True).probs[0]


def _renorm(kept: list[float]) -> list[float]:
    return [p / sum(kept) for p in kept]


@pytest.mark.parametrize("perm", [[0, 1, 2, 3], [2, 0, 3, 1]])
@pytest.mark.parametrize("top_p, kept", [(0.8, 2), (0.81, 3), (0.5, 1), (0.49, 1), (0.96, 4)])
def test_top_p_mask_exact(perm, top_p, kept):
    probs = _hand_probs(perm, top_p=top_p)
    expect = torch.zeros(4)
    for p, tok in zip(_renorm(HAND[:kept]), perm[:kept], strict=True):
        expect[tok] = p
    torch.testing.assert_close(probs, expect, rtol=1e-5, atol=1e-7)


def test_top_p_one_keeps_tiny_tail_when_batched_with_top_p_row():
    v = 6
    logits = torch.tensor([[0.0, -30.0, -30.0, -30.0, -30.0, -30.0]] * 2)
    params = [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)]
    probs = SAMPLER(logits, meta_for(params, v), return_probs=True).probs
    assert bool((probs[0] > 0).all())
    assert (probs[1] > 0).sum() == 1


@pytest.mark.parametrize("min_p, kept", [(0.2, 3), (0.35, 2), (0.65, 1), (0.11, 3), (0.09, 4)])
def test_min_p_mask_exact(min_p, kept):
    probs = _hand_probs([3, 1, 0, 2], min_p=min_p)
    expect = torch.zeros(4)
    for p, tok in zip(_renorm(HAND[:kept]), [3, 1, 0, 2][:kept], strict=True):
        expect[tok] = p
    torch.testing.assert_close(probs, expect, rtol=1e-5, atol=1e-7)


def _seeded_run(seed_rows: dict[int, int], n: int, logits_row: torch.Tensor, steps: int):
    """Decode `steps` times; returns {row: [tokens]} for the seeded rows."""
    gens = [None] * n
    for row, seed in seed_rows.items():
        gens[row] = torch.Generator().manual_seed(seed)
    v = logits_row.numel()
    meta = meta_for([SamplingParams(temperature=1.0, seed=seed_rows.get(i)) for i in range(n)],
                    v, gens=gens)
    toks = {row: [] for row in seed_rows}
    for _ in range(steps):
        out = SAMPLER(logits_row.expand(n, v).contiguous(), meta)
        for row in seed_rows:
            toks[row].append(int(out.next_tokens[row]))
    return toks


def test_seeds_reproducible_across_batch_position_and_composition():
    logits = torch.zeros(1000)  # uniform: 20 tokens in a row collide by chance ~never
    torch.manual_seed(5)
    a = _seeded_run({0: 1234}, 2, logits, 20)[0]
    torch.manual_seed(99)  # the default generator must not matter for seeded rows
    torch.rand(7)
    b = _seeded_run({2: 1234, 0: 777}, 5, logits, 20)
    c = _seeded_run({4: 1234}, 5, logits, 20)[4]
    assert a == b[2] == c
    assert b[0] != a  # different seed, different stream
    # Unseeded rows are not pinned: two runs from different default states differ.
    torch.manual_seed(6)
    u1 = SAMPLER(logits.expand(8, 1000).contiguous(), meta_for([SamplingParams()] * 8, 1000))
    u2 = SAMPLER(logits.expand(8, 1000).contiguous(), meta_for([SamplingParams()] * 8, 1000))
    assert not torch.equal(u1.next_tokens, u2.next_tokens)


def ref_penalties(logits, prompts, outputs, params):
    out = logits.clone()
    for i, p in enumerate(params):
        for tok in set(prompts[i]) | set(outputs[i]):
            x = float(out[i, tok])
            out[i, tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for tok in set(outputs[i]):
            c = outputs[i].count(tok)
            out[i, tok] -= p.frequency_penalty * c + p.presence_penalty
    return out


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.3), dict(repetition_penalty=0.7), dict(frequency_penalty=0.6),
    dict(presence_penalty=-0.8),
    dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=1.1),
])
def test_penalties_equal_reference(kw):
    torch.manual_seed(7)
    v = 30
    logits = torch.randn(4, v) * 3
    prompts = [[1, 2, 2, 5], [], [7, 8, 9, 10, 11, 12], [3]]
    outputs = [[2, 6, 6, 6], [4, 4, 0], [], [3, 29, 3]]
    # Row 1 has no penalty: it must come through untouched even though it has outputs.
    params = [SamplingParams(temperature=0.0, **kw), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, **kw), SamplingParams(temperature=0.0, **kw)]
    meta = meta_for(params, v, prompts, outputs)
    out = SAMPLER(logits, meta)
    ref = ref_penalties(logits, prompts, outputs, params)
    torch.testing.assert_close(apply_penalties(logits, meta), ref, rtol=1e-6, atol=1e-6)
    # Greedy rows see penalties (not temperature): argmax of the penalised logits.
    assert torch.equal(out.next_tokens, ref.argmax(dim=-1))


def test_logprobs_are_raw_and_top_logprobs_sorted():
    torch.manual_seed(8)
    n, v = 6, 25
    logits = torch.randn(n, v) * 2
    params = [SamplingParams(temperature=0.6, top_k=3, repetition_penalty=1.5, logprobs=5),
              SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=0),
              SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=2.0, min_p=0.2, logprobs=1),
              SamplingParams(temperature=1.0)]
    outputs = [[int(logits[0].argmax())], [int(logits[1].argmax())] * 3, [], [], [], []]
    meta = meta_for(params, v, outputs=outputs)
    assert meta.max_num_logprobs == 5
    out = SAMPLER(logits.to(torch.bfloat16).float(), meta)
    raw = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    expect = raw.gather(1, out.next_tokens[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expect, rtol=0, atol=0)
    assert out.top_tokens.shape == (n, 5) and out.top_logprobs.dtype == torch.float32
    vals, idx = raw.topk(5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, vals, rtol=0, atol=0)
    assert torch.equal(out.top_tokens, idx)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    # bf16 input is accepted and treated as float32.
    out16 = SAMPLER(logits.to(torch.bfloat16), meta_for([SamplingParams(temperature=0.0,
                                                                       logprobs=1)] * n, v))
    assert out16.logprobs.dtype == torch.float32
    assert torch.equal(out16.next_tokens, logits.to(torch.bfloat16).float().argmax(-1))


def test_build_maps_fields_pads_and_sets_flags():
    v = 100
    params = [SamplingParams(top_k=-1), SamplingParams(top_k=5, top_p=0.9, min_p=0.1),
              SamplingParams(temperature=0.0, top_k=7, top_p=0.5), SamplingParams(top_k=v)]
    m = meta_for(params, v, prompts=[[1, 2], [3], [4, 5, 6], []],
                 outputs=[[9], [], [8, 8], [1]])
    assert m.top_k.tolist() == [0, 5, 0, 0]  # -1 -> 0; greedy rows and k >= vocab disabled
    assert m.top_k.dtype == torch.int64 and m.temperature.dtype == torch.float32
    assert m.temperature.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert m.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert (m.all_greedy, m.all_random, m.no_top_k, m.no_top_p, m.no_min_p, m.no_penalties) == (
        False, False, False, False, False, True)
    assert m.prompt_token_ids is None and m.output_token_ids is None
    assert m.max_num_logprobs is None and m.generators == {}

    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.1, logprobs=3),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.0, presence_penalty=0.5)]
    m = meta_for(params, v, prompts=[[1, 2, 3], [4, 4, 4, 4, 4], [5]],
                 outputs=[[7], [8, 9], []], gens=[None, g, None])
    assert m.all_greedy and not m.all_random and not m.no_penalties
    assert m.no_top_k and m.no_top_p and m.no_min_p
    assert m.max_num_logprobs == 3 and m.generators == {1: g}
    # Row 1 has no penalties, so it contributes padding only.
    assert m.prompt_token_ids.tolist() == [[1, 2, 3], [v, v, v], [5, v, v]]
    assert m.output_token_ids.tolist() == [[7], [v], [v]]
    assert m.repetition_penalty.tolist() == pytest.approx([1.1, 1.0, 1.0])
    moved = m.to(torch.device("cpu"))
    assert moved.generators is m.generators and torch.equal(moved.top_k, m.top_k)


def test_all_random_flag_and_empty_outputs_with_penalties():
    v = 20
    params = [SamplingParams(temperature=1.0, repetition_penalty=2.0)] * 3
    m = meta_for(params, v, prompts=[[1], [2], [3]])
    assert m.all_random and m.output_token_ids.shape == (3, 0)
    logits = torch.full((3, v), -5.0)
    logits[:, 1:4] = 4.0
    out = SAMPLER(logits, m, return_probs=True)
    # Row i's prompt token (i + 1) is penalised 4 -> 2, so it is e^2 less likely than peers.
    for i in range(3):
        peers = [t for t in (1, 2, 3) if t != i + 1]
        ratio = out.probs[i, peers[0]] / out.probs[i, i + 1]
        assert float(ratio) == pytest.approx(math.exp(2.0), rel=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.0, 1e-30, 1e-7, 0.3, 1.0, 5.0]), min_size=1,
                max_size=40),
       st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=6),
       st.booleans())
def test_token_at_never_picks_a_zero_probability_token(weights, us, scaled):
    """Any point in [0, 1), the ends included (u = 0 and the largest float64 below 1), lands
    on a token with mass, for unnormalised rows (the rejection sampler's residuals) too."""
    if not any(w > 0 for w in weights):
        weights = weights + [1.0]
    row = torch.tensor(weights, dtype=torch.float32) * (3.0 if scaled else 1.0)
    us = us + [0.0, math.nextafter(1.0, 0.0)]
    probs = row.expand(len(us), -1).contiguous()
    got = token_at(probs, torch.tensor(us, dtype=torch.float64).unsqueeze(1))
    assert bool((probs.gather(1, got.unsqueeze(1)) > 0).all())
    # and it is the inverse CDF: the first token whose cumulative mass passes u * total
    cdf = torch.cumsum(row.double(), 0).tolist()
    for u, tok in zip(us, got.tolist(), strict=True):
        point = u * cdf[-1]
        want = next(i for i, c in enumerate(cdf) if c > point and row[i] > 0)
        near_edge = min(abs(c - point) for c in cdf) <= 1e-6 * cdf[-1]   # float32 rounding
        assert tok == want or near_edge


def test_seeded_draw_is_one_uniform_from_the_rows_generator():
    """A seeded row consumes one uniform a step from its own generator, whatever the
    vocabulary: the generator's next draw is the same after sampling rows of any width."""
    after = []
    for v in (10, 49152):
        gen = torch.Generator().manual_seed(42)
        sample_from_probs(torch.ones(1, v), {0: gen})
        after.append(torch.rand(1, generator=gen, dtype=torch.float64).item())
    ref = torch.Generator().manual_seed(42)
    torch.rand(1, generator=ref, dtype=torch.float64)
    assert after[0] == after[1] == torch.rand(1, generator=ref, dtype=torch.float64).item()
