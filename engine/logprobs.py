"""The one logprob type every layer shares: engine, wire conversion, router, clients.

A generated token's raw logprob plus the k most likely tokens of its step (descending).
The sampled token appears among `top` only when it ranks in the top k, as in OpenAI's
`top_logprobs`; k = 0 gives an empty `top`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(token_id: int, logprob: float, top_tokens, top_logprobs,
                  k: int) -> TokenLogprob:
    """Build one entry from a sampler row: the first k of the row's descending top list."""
    top = tuple(zip(top_tokens[:k], top_logprobs[:k], strict=True)) if k else ()
    return TokenLogprob(token_id, logprob, top)
