"""Rejection sampling of draft tokens against the target, batched
(docs/ARCHITECTURE.md, 'The execution trunk', step 8.3).

Per sequence b with num_drafts[b] <= K drafts d_1..d_k, the target's distributions p_0..p_k
(row j scores the token after d_j; row 0 the token after the current one) and the draft's
q_1..q_k (the distributions d_j were drawn from):

- greedy rows: d_j is accepted while it equals the target's argmax at row j-1;
- random rows: d_j is accepted with probability min(1, p(d_j) / q(d_j)); at the first
  rejection the token is drawn from normalize(max(0, p - q)) instead, which makes every
  emitted token distributed exactly as the target's p (Leviathan et al., Chen et al.);
- if all drafts are accepted, the bonus token is the target's own sample at the last row.

So each sequence emits num_accepted + 1 tokens. No host sync happens here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import sample_from_probs


@dataclass
class RejectionOutput:
    num_accepted: torch.Tensor   # [B] int64
    tokens: torch.Tensor         # [B, K+1] int64: accepted drafts, then the final token, -1 pad


def rejection_sample(draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                     draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     target_tokens: torch.Tensor, is_greedy: torch.Tensor,
                     generators: dict[int, torch.Generator] | None = None,
                     recover_from_target: bool = False) -> RejectionOutput:
    """draft_tokens [B, K], num_drafts [B], draft_probs [B, K, V], target_probs [B, K+1, V],
    target_tokens [B, K+1] (the target's sample, argmax on greedy rows), is_greedy [B].

    `recover_from_target` is the deliberately wrong variant (resample from p on rejection,
    which double-counts the mass where p > q); it exists so the distribution test can
    show that it fails.
    """
    generators = generators or {}
    b, k = draft_tokens.shape
    dev = draft_tokens.device
    if k == 0:
        return RejectionOutput(torch.zeros(b, dtype=torch.int64, device=dev),
                               target_tokens[:, :1].clone())
    safe = draft_tokens.clamp_min(0).unsqueeze(2)
    p_d = target_probs[:, :k].gather(2, safe).squeeze(2)
    q_d = draft_probs.gather(2, safe).squeeze(2)
    u = torch.rand(b, k, device=dev)
    for row, gen in generators.items():
        u[row] = torch.rand(k, generator=gen, device=dev)
    accept_random = u * q_d < p_d                      # u < p/q, no division by q
    accept_greedy = draft_tokens == target_tokens[:, :k]
    accept = torch.where(is_greedy.unsqueeze(1), accept_greedy, accept_random)
    accept &= torch.arange(k, device=dev).unsqueeze(0) < num_drafts.unsqueeze(1)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

    # the final token: recovered at the first rejection, else the bonus at row num_drafts
    at = num_accepted.clamp_max(k - 1)
    rows = torch.arange(b, device=dev)
    p_at, q_at = target_probs[rows, at], draft_probs[rows, at]
    residual = p_at if recover_from_target else (p_at - q_at).clamp_min(0)
    mass = residual.sum(dim=1, keepdim=True)
    # p == q exactly leaves no residual; rejection then has probability 0, keep p anyway
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    recovered = sample_from_probs(residual, generators)
    recovered = torch.where(is_greedy, target_tokens[rows, at], recovered)
    bonus = target_tokens[rows, num_accepted]
    final = torch.where(num_accepted < num_drafts, recovered, bonus)

    pos = torch.arange(k + 1, device=dev).unsqueeze(0)
    drafts_padded = torch.cat((draft_tokens, torch.full((b, 1), -1, device=dev,
                                                        dtype=draft_tokens.dtype)), 1)
    tokens = torch.where(pos < num_accepted.unsqueeze(1), drafts_padded,
                         torch.full_like(drafts_padded, -1))
    tokens[rows, num_accepted] = final
    return RejectionOutput(num_accepted, tokens)
