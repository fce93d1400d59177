"""Sampler: logits of the selected rows -> next tokens (+ logprobs)
(docs/ARCHITECTURE.md, 'The execution trunk', step 6).

Order: penalties -> temperature -> top-k -> top-p -> min-p -> softmax -> sample -> logprobs.
Everything is batched over rows; the only Python loop is over seeded rows' generators. On
an accelerator no `.item()` or other host read-back happens here, so a step never stalls
on the device: the decisions that skip work (all_greedy, no_top_k, ...) were taken on the
host in SamplingMetadata.build. On a CPU, where a read-back costs nothing, top-k / top-p
and the draw's guard read counts back to skip work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers import cpu_fused_ops
from engine.sampling_metadata import SamplingMetadata
from engine.top_k_top_p import apply_top_k_top_p

__all__ = ["SampleOutput", "Sampler", "apply_penalties", "apply_top_k_top_p", "apply_min_p",
           "sample_from_probs", "token_at"]


@dataclass
class SampleOutput:
    next_tokens: torch.Tensor  # [N] int64
    # [N] float32: the sampled token's logprob under the RAW logits (vLLM v1 "raw_logprobs"),
    # so greedy logprobs equal HF's log_softmax of its logits.
    logprobs: torch.Tensor | None
    top_tokens: torch.Tensor | None  # [N, k] int64 (k = max_num_logprobs), descending
    top_logprobs: torch.Tensor | None  # [N, k] float32 raw logprobs
    # [N, V] float32 final sampling distribution (one-hot at the argmax for greedy rows), only
    # with return_probs=True; speculative decoding's rejection sampler needs it.
    probs: torch.Tensor | None


class Sampler(torch.nn.Module):
    def __init__(self, cpu_argmax: bool = False):
        super().__init__()
        # greedy rows' argmax on CPU through the C++ kernel (engine/layers/cpu_fused_ops.py
        # argmax_rows, the same indices): torch's reduction took 0.8 ms of a 40 ms decode
        # step at batch 32 (SmolLM2's 49,152-token vocabulary)
        self.cpu_argmax = cpu_argmax and cpu_fused_ops.available()

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if (self.cpu_argmax and logits.dim() == 2
                and cpu_fused_ops.fits(logits, cpu_fused_ops.EXACT_DTYPES)):
            return cpu_fused_ops.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def forward(
        self, logits: torch.Tensor, meta: SamplingMetadata, return_probs: bool = False
    ) -> SampleOutput:
        if (meta.all_greedy and meta.no_penalties and meta.max_num_logprobs is None
                and not return_probs):
            # a plain greedy batch needs only the argmax, and widening to float32 changes
            # no value (every bf16/fp16 number is a float32), so no index: over a batch-64
            # decode step's [64, 49152] bf16 logits the copy and a float32 argmax took 0.70
            # ms, the C++ argmax on the bf16 rows 0.16 (of a ~70 ms step)
            return SampleOutput(self._argmax(logits), None, None, None, None)
        if logits.dtype != torch.float32:
            logits = logits.float()
        raw = logits  # never modified in place below, so it stays the raw logits

        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)

        greedy = None if meta.all_random else self._argmax(logits)
        probs = None
        if meta.all_greedy:
            next_tokens = greedy
            if return_probs:
                probs = _one_hot(greedy, logits.shape[-1])
        else:
            # Greedy rows carry temperature 0; divide them by 1 (their result is discarded).
            temp = torch.where(meta.temperature > 0, meta.temperature, 1.0)
            logits = logits / temp.unsqueeze(1)
            if not (meta.no_top_k and meta.no_top_p):
                logits = apply_top_k_top_p(
                    logits,
                    None if meta.no_top_k else meta.top_k,
                    None if meta.no_top_p else meta.top_p,
                )
            if not meta.no_min_p:
                logits = apply_min_p(logits, meta.min_p)
            probs = torch.softmax(logits, dim=-1)
            sampled = sample_from_probs(probs, meta.generators)
            if meta.all_random:
                next_tokens = sampled
            else:
                is_greedy = meta.temperature == 0
                next_tokens = torch.where(is_greedy, greedy, sampled)
                if return_probs:
                    one_hot = _one_hot(greedy, probs.shape[-1])
                    probs = torch.where(is_greedy.unsqueeze(1), one_hot, probs)
            if not return_probs:
                probs = None

        lp = top_tokens = top_lp = None
        if meta.max_num_logprobs is not None:
            raw_lp = torch.log_softmax(raw, dim=-1)
            lp = raw_lp.gather(1, next_tokens.unsqueeze(1)).squeeze(1)
            # topk returns values sorted descending, which is the order the API promises.
            top_lp, top_tokens = raw_lp.topk(meta.max_num_logprobs, dim=-1)
        return SampleOutput(next_tokens, lp, top_tokens, top_lp, probs)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output, once per distinct token), then frequency and presence
    (output only). Returns a new tensor; `logits` is left untouched."""
    n, v = logits.shape
    assert meta.prompt_token_ids is not None and meta.output_token_ids is not None
    out_ids = meta.output_token_ids
    # Pad id is v: scatter into v + 1 columns and drop the last, so padding costs no masking.
    counts = torch.zeros(n, v + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :v]
    in_prompt = torch.zeros(n, v + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, meta.prompt_token_ids, True)
    seen = in_prompt[:, :v] | (counts > 0)

    rep = meta.repetition_penalty.unsqueeze(1)
    # HF / vLLM formula: shrink positive logits, push negative ones further down.
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - meta.frequency_penalty.unsqueeze(1) * counts
    logits = logits - meta.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with prob >= min_p * max_prob (min_p = 0 keeps everything)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample_from_probs(probs: torch.Tensor, generators: dict[int, torch.Generator]
                      ) -> torch.Tensor:
    """One token per row, drawn with probability probs[row] / probs[row].sum(): the first
    token whose cumulative mass passes u * total, u ~ U[0, 1), one uniform per row, no host
    sync.

    Why not the exponential race (argmax probs / q, q ~ Exp(1) per token) used before: it
    draws a whole vocabulary of exponentials per row, 17 ns each on a CPU, ~55 ms a
    batch-64 step over SmolLM2's 49,152 tokens, more than the model's own decode step; a
    cumulative sum costs a few ms. Unseeded rows share one draw from the default generator;
    each seeded row draws its own uniform from its generator, so its tokens depend only on
    its seed and step, never on where it sits in the batch or who its neighbours are.
    """
    n = probs.shape[0]
    dev = probs.device
    u = torch.rand(n, 1, device=dev, dtype=torch.float64)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, dtype=torch.float64).to(dev)
    return token_at(probs, u)


def token_at(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the first token whose cumulative mass exceeds u[row] * total, u in [0, 1)
    float64 [N, 1]; never a token of zero probability."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # u < 1, but u * total may round up to total: keep the point strictly inside the mass
    point = torch.minimum((u * total.double()).to(cdf.dtype),
                          torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, point, right=True).clamp_max(probs.shape[-1] - 1)
    # the token found has cdf[t] > point >= cdf[t-1], so mass of its own, unless a blocked
    # cumulative sum rounded two equal prefixes apart: never emit a zero-probability token
    # (on a CPU only the rows concerned pay the argmax; elsewhere no host sync for it)
    zero = probs.gather(1, tokens) <= 0
    if probs.device.type != "cpu":
        return torch.where(zero, probs.argmax(dim=-1, keepdim=True), tokens).squeeze(1)
    if bool(zero.any()):
        rows = zero.squeeze(1).nonzero().squeeze(1)
        tokens[rows] = probs[rows].argmax(dim=-1, keepdim=True)
    return tokens.squeeze(1)


def _one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # scatter rather than F.one_hot, which may range-check its input with a device read-back.
    out = torch.zeros(tokens.shape[0], vocab_size, dtype=torch.float32, device=tokens.device)
    return out.scatter_(1, tokens.unsqueeze(1), 1.0)
