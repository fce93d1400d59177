"""Scheduler side of a speculative step: append the accepted run, apply stops token by
token, and roll back the KV slots of rejected drafts.

A decode sequence was scheduled with blocks for len + k tokens (the scheduler's lookahead).
The target computed K/V for its current token and all k drafts, but only the current token
and the accepted drafts are valid: n_kv_cache_tokens advances by 1 + accepted, and blocks
beyond that are returned (BlockManager.truncate), which leaves the block table exactly as
plain decoding would have it. Rejected drafts' K/V in the kept blocks are simply
overwritten later (nothing reads past a sequence's length). Tokens after a stop condition
inside the accepted run are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.logprobs import TokenLogprob
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence


@dataclass
class SeqStepResult:
    tokens: list[int]                 # emitted this step, in order
    num_accepted: int = 0             # of them, accepted drafts (the rest: 1 final token)
    logprobs: list[TokenLogprob] | None = field(default=None)


def postprocess_speculative(scheduler: Scheduler, sched: SchedulerOutput,
                            results: dict[int, SeqStepResult],
                            eos_token_ids: frozenset[int]) -> tuple[list[Sequence], int]:
    """Returns (sequences that gained tokens, number of tokens appended)."""
    bm = scheduler.bm
    grew, appended = [], 0
    for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
        is_decode = n == 1 and seq.num_uncomputed_tokens == 1
        r = results.get(seq.seq_id)
        if r is None:                    # a prefill chunk that did not reach the last token
            seq.num_cached_tokens += n
            bm.cache_full_blocks(seq)
            continue
        computed_to = seq.num_cached_tokens + (1 + r.num_accepted if is_decode else n)
        for i, token in enumerate(r.tokens):
            seq.append_token(token)
            appended += 1
            if r.logprobs is not None:
                seq.logprobs.append(r.logprobs[i])
            # K/V valid up to the token before the newest one (as in plain decoding)
            seq.num_cached_tokens = min(computed_to, len(seq) - 1)
            bm.cache_full_blocks(seq)
            scheduler.check_stop(seq, eos_token_ids)
            if seq.is_finished:
                break                    # tokens past a stop are dropped
        if not seq.is_finished:
            bm.truncate(seq, seq.num_cached_tokens)
        grew.append(seq)
    return grew, appended
