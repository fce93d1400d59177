"""The rejection sampler emits tokens distributed exactly as the target, whatever the draft;
a deliberately wrong recovery rule fails the same test. Greedy rows: argmax comparison."""

from __future__ import annotations

import torch

from engine.speculative.rejection_sampler import rejection_sample

N = 120_000
P_TARGET = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])
Q_DRAFT = torch.tensor([0.05, 0.10, 0.30, 0.20, 0.05, 0.05, 0.20, 0.05])


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; p-value = Q(df/2, chi2/2) (regularised
    upper incomplete gamma), so no scipy is needed."""
    n = counts.sum()
    expected = probs.double() * n
    chi2 = ((counts.double() - expected) ** 2 / expected).sum()
    df = torch.tensor(float(len(probs) - 1), dtype=torch.float64)
    return torch.special.gammaincc(df / 2, chi2 / 2).item()


def _emitted(wrong: bool, k: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = len(P_TARGET)
    drafts = torch.multinomial(Q_DRAFT, N * k, replacement=True, generator=g).view(N, k)
    target_tokens = torch.multinomial(P_TARGET, N * (k + 1), replacement=True,
                                      generator=g).view(N, k + 1)
    torch.manual_seed(seed + 1)
    out = rejection_sample(drafts, torch.full((N,), k), Q_DRAFT.expand(N, k, v),
                           P_TARGET.expand(N, k + 1, v), target_tokens,
                           torch.zeros(N, dtype=torch.bool), recover_from_target=wrong)
    return out.tokens


def test_first_token_follows_target_distribution():
    tokens = _emitted(wrong=False)
    counts = torch.bincount(tokens[:, 0], minlength=len(P_TARGET))
    p = chi_square_pvalue(counts, P_TARGET)
    assert p > 1e-3, f"chi-square p={p:.2e}: emitted {counts.tolist()}"


def test_every_emitted_position_follows_target_with_three_drafts():
    # i.i.d. target rows: every emitted token (accepted draft, recovered or bonus) ~ p
    tokens = _emitted(wrong=False, k=3, seed=5)
    for j in range(4):
        col = tokens[:, j]
        col = col[col >= 0]
        counts = torch.bincount(col, minlength=len(P_TARGET))
        p = chi_square_pvalue(counts, P_TARGET)
        assert p > 1e-3, f"position {j}: chi-square p={p:.2e}"


def test_wrong_recovery_rule_fails_the_same_test():
    tokens = _emitted(wrong=True)
    counts = torch.bincount(tokens[:, 0], minlength=len(P_TARGET))
    assert chi_square_pvalue(counts, P_TARGET) < 1e-6


def test_acceptance_rate_is_overlap_of_p_and_q():
    tokens = _emitted(wrong=False)
    # accepted drafts leave a second (bonus) token; P(accept) = sum min(p, q)
    accepted = (tokens[:, 1] >= 0).double().mean().item()
    expect = torch.minimum(P_TARGET, Q_DRAFT).sum().item()
    assert abs(accepted - expect) < 0.01


def test_greedy_rows_compare_with_argmax_and_emit_target_token():
    v = 5
    drafts = torch.tensor([[1, 2, 3], [1, 4, 0], [0, 0, 0]])
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [4, 4, 4, 4]])
    probs = torch.nn.functional.one_hot(target, v).float()
    out = rejection_sample(drafts, torch.tensor([3, 3, 2]), torch.zeros(3, 3, v), probs,
                           target, torch.ones(3, dtype=torch.bool))
    assert out.num_accepted.tolist() == [3, 1, 0]
    assert out.tokens.tolist() == [[1, 2, 3, 4], [1, 2, -1, -1], [4, -1, -1, -1]]


def test_num_drafts_limits_acceptance_and_bonus_row():
    v = 4
    drafts = torch.tensor([[1, 2], [1, 2]])
    target = torch.tensor([[1, 2, 3], [1, 2, 3]])
    probs = torch.nn.functional.one_hot(target, v).float()
    out = rejection_sample(drafts, torch.tensor([1, 0]), torch.zeros(2, 2, v), probs, target,
                           torch.ones(2, dtype=torch.bool))
    assert out.num_accepted.tolist() == [1, 0]
    assert out.tokens.tolist() == [[1, 2, -1], [1, -1, -1]]
