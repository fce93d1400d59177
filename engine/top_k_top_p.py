"""Top-k / top-p masking of sampling logits (the Sampler's step after temperature).

The definition is the sorted one (`top_k_top_p_sorted`): one stable descending sort of each
row, the first k positions survive top-k, then the smallest prefix of the survivors whose
mass reaches p survives top-p; ties are broken toward the lower token id. A full sort of
a 49,152-token row costs about 4 ms on a 2-core CPU, so a batch of 64 sampled rows spent
~270 ms a step sorting, several decode steps' worth.

On CPU `apply_top_k_top_p` first asks the C++ kernel (engine/csrc/cpu/top_k_top_p.cpp):
a row's tokens of probability >= 1e-4 (then >= 1e-9) are the first of its sorted order, so
they decide the cut unless top-k reaches below them or the nucleus is wider; sorting only
them, and only as far as the cut, made sampled decoding 2.4x faster at batch 64 (history:
"Sampled decoding: one uniform a row, top-p in C++"). The rows it leaves undecided take
the candidates' path below.

The candidates' path computes the same mask from the top candidates only: the
number of positions a row keeps, c, depends only on the sorted values, and torch.topk
gives the largest values in the same descending order. Once c is known, a row keeps every
logit above its c-th value b and, among the logits equal to b, the lowest ids until c are
kept, which is the stable sort's tie-break. A row whose cut lies beyond the candidates
(a flat distribution with p near 1, or a top-k larger than the candidate count) is
decided again from more candidates and, past the last width, by the full sort. The
decision reads the counts back to the host, so accelerators keep the sort (it is fast
there and this module must not stall their stream).

Cost at 64 rows, 2 threads (AMX Xeon): topk of 1,024 candidates 25 ms, of 8,192 56 ms,
the stable sort 224 ms. A row decided from 1,024 candidates costs about a tenth of the
sort; a row whose nucleus is wider than 8,192 tokens (near-uniform logits with p near 1)
pays both topks before the sort, about 1.4x the sort alone. Generating part 8 of the MTP
corpus (256 rows sampled at temperature 0.8, top-p 0.95, one seed each, 128 tokens) took
86 s a batch against 123 s with the sort (greedy: 16 s; the exponential race that then
drew the token was most of the rest, engine/sampler.py sample_from_probs).
"""

from __future__ import annotations

import torch

from engine.layers import cpu_fused_ops

# Slack when deciding whether the tokens before a candidate already reach top_p. Probabilities
# come out of a float32 softmax + cumsum, so a cumulative mass that is mathematically exactly
# top_p can land either side of it by ~1e-7; without slack the kept set would flip on rounding.
TOP_P_EPS = 1e-6
# candidate widths tried in turn before the full sort
CANDIDATES = (1024, 8192)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """`logits` with everything outside top-k, then outside top-p (over the top-k
    survivors), set to -inf; per-row `top_k` (<= 0: off) and `top_p` (1: off)."""
    if logits.device.type != "cpu" or logits.shape[-1] <= CANDIDATES[0]:
        return top_k_top_p_sorted(logits, top_k, top_p)
    if _kernel_serves(logits):
        return _by_likely_tokens(logits, top_k, top_p)
    return _by_candidates(logits, top_k, top_p, 0)


def _kernel_serves(logits: torch.Tensor) -> bool:
    return (logits.dtype == torch.float32 and logits.dim() == 2
            and cpu_fused_ops.available())


def _by_likely_tokens(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """The C++ kernel (engine/csrc/cpu/top_k_top_p.cpp) decides each row from its tokens of
    non-negligible probability; the rows it leaves undecided take the candidates' path."""
    logits = logits.contiguous()
    empty = torch.empty(0)
    lse = torch.logsumexp(logits, -1) if top_p is not None else empty
    out, decided = cpu_fused_ops.EXTENSION.load().top_k_top_p_cut(
        logits, lse, empty.long() if top_k is None else top_k.long(),
        empty if top_p is None else top_p.float(), TOP_P_EPS)
    if not bool(decided.all()):
        rows = (~decided).nonzero().squeeze(1)
        out[rows] = _by_candidates(logits[rows], None if top_k is None else top_k[rows],
                                   None if top_p is None else top_p[rows], 0)
    return out


def top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """The definition: one stable descending sort per row, masks positional in it."""
    v = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(v, device=logits.device).unsqueeze(0)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, v).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(pos >= k, float("-inf"))
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Mass strictly before each token: a token is needed iff that mass has not reached p.
        # This keeps the smallest prefix whose mass >= p, and always keeps position 0.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = top_p.unsqueeze(1)
        drop = (before >= p - TOP_P_EPS) & (p < 1.0)  # p == 1 rows keep even the tiniest tail
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _by_candidates(logits: torch.Tensor, top_k: torch.Tensor | None,
                   top_p: torch.Tensor | None, width_index: int) -> torch.Tensor:
    if width_index == len(CANDIDATES) or CANDIDATES[width_index] >= logits.shape[-1]:
        return top_k_top_p_sorted(logits, top_k, top_p)
    width = CANDIDATES[width_index]
    vals = logits.topk(width, dim=-1, sorted=True).values
    kept, keep_all, decided = _kept_counts(logits, vals, top_k, top_p)
    boundary = vals.gather(1, (kept - 1).clamp(0, width - 1).unsqueeze(1))
    above = logits > boundary
    tied = logits == boundary
    need = (kept - above.sum(-1)).unsqueeze(1)
    keep = above | (tied & (tied.cumsum(-1) <= need)) | keep_all.unsqueeze(1)
    out = logits.masked_fill(~keep, float("-inf"))
    if not bool(decided.all()):
        rows = (~decided).nonzero().squeeze(1)
        out[rows] = _by_candidates(logits[rows], None if top_k is None else top_k[rows],
                                   None if top_p is None else top_p[rows], width_index + 1)
    return out


def _kept_counts(logits: torch.Tensor, vals: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions each row keeps in sorted order, rows that keep everything, rows whose
    count the candidates `vals` decide)."""
    n, v = logits.shape
    width = vals.shape[1]
    k = (torch.full((n,), v, dtype=torch.long) if top_k is None
         else torch.where(top_k > 0, top_k, v).long().clamp(max=v))
    p = torch.ones(n) if top_p is None else top_p.float()
    cuts_p = p < 1.0
    keep_all = (k >= v) & ~cuts_p
    # rows whose top-k survivors reach past the candidates: their top-p normalizer (and,
    # without top-p, their cut) is not among the candidates, unless they keep everything
    unknown_mass = (k > width) & (k < v)
    kept = k.clone()
    if bool(cuts_p.any()):
        pos = torch.arange(width).unsqueeze(0)
        survivors = vals.masked_fill(pos >= k.unsqueeze(1), float("-inf"))
        norm = torch.where(k >= v, torch.logsumexp(logits, -1),
                           torch.logsumexp(survivors, -1))
        probs = torch.exp(survivors - norm.unsqueeze(1))
        before = probs.cumsum(-1) - probs
        drop = (before >= p.unsqueeze(1) - TOP_P_EPS) & cuts_p.unsqueeze(1)
        drop[:, 0] = False
        found = drop.any(-1)
        first = torch.where(found, drop.int().argmax(-1), v)
        kept = torch.minimum(k, first)
        decided = ~unknown_mass & (found | (k <= width) | ~cuts_p)
    else:
        decided = ~unknown_mass
    decided |= keep_all
    return kept, keep_all, decided
