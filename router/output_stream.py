"""Token batches from a backend -> text deltas, with stop strings applied in the router.

Follows the offline engine's `OutputProcessor` exactly (same incremental detokenizer, stop
search from just before the new text, text cut before the stop string, the request ends at
the batch that completed it), so PD output equals single-node `LLM` output. While
streaming, the last (longest stop - 1) characters are held back until no stop string can
start in them, so a client never receives text that a later stop would have cut.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.logprobs import TokenLogprob
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from router.backend import Backend, NodeRequest


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestResult:
    """Accumulated over the deltas, for non-streaming responses and usage."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_time: float | None = None


async def stream_request(backend: Backend, tok: Tokenizer, request: NodeRequest,
                         result: RequestResult, on_tokens=None) -> AsyncIterator[Delta]:
    """Yields deltas; fills `result` as it goes. `on_tokens(n)` is called per batch (metrics).
    Closing this iterator early closes the backend's, which aborts the request on the nodes."""
    params = request.params
    detok = IncrementalDetokenizer(tok, params.skip_special_tokens)
    stops = params.stop
    hold = max((len(s) for s in stops), default=1) - 1
    emitted = 0
    result.num_prompt_tokens = len(request.prompt_token_ids)
    want_logprobs = params.logprobs is not None
    if want_logprobs:
        result.logprobs = []
    gen = backend.generate(request)
    try:
        async for step in gen:
            if step.token_ids and result.first_token_time is None:
                result.first_token_time = time.monotonic()
            if on_tokens is not None and step.token_ids:
                on_tokens(len(step.token_ids))
            result.num_cached_tokens = max(result.num_cached_tokens, step.num_cached_tokens)
            result.token_ids.extend(step.token_ids)
            lps = step.logprobs if want_logprobs else None
            if lps:
                result.logprobs.extend(lps)
            new_text = detok.add(step.token_ids)
            finish, reason = step.finish_reason, step.stop_reason
            if finish is not None:
                new_text += detok.flush()
            stop = detok.cut_at_stop(new_text, stops)
            if stop is not None:
                finish, reason = "stop", stop
            if finish is None:
                safe = len(detok.text) - hold
                chunk = detok.text[emitted:safe] if safe > emitted else ""
            else:
                chunk = detok.text[emitted:]
            emitted += len(chunk)
            if finish is not None:
                result.text = detok.text
                result.finish_reason, result.stop_reason = finish, reason
                yield Delta(chunk, step.token_ids, lps, finish, reason)
                return
            if chunk or step.token_ids:
                yield Delta(chunk, step.token_ids, lps)
    finally:
        await gen.aclose()
        result.text = detok.text

