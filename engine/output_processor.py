"""Text on top of token ids: incremental detokenization, stop strings, RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.commands import EngineOutput
from engine.logprobs import TokenLogprob
from engine.sequence import Sequence
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0


class OutputProcessor:
    """Keeps one detokenizer per live request, applies stop strings, and makes each
    request's EngineOutput deltas (what it gained since its last output)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._seen: dict[int, int] = {}
        self._sent: dict[int, tuple[int, int]] = {}    # seq_id -> (tokens, text chars)

    def delta(self, seq: Sequence) -> EngineOutput | None:
        """The output for what `seq` gained since the last one (None: nothing new). The
        final one carries the finish and usage and forgets the sequence."""
        sent_tokens, sent_text = self._sent.get(seq.seq_id, (0, 0))
        out = seq.output_token_ids
        new = out[sent_tokens:]
        if not new and not seq.is_finished:
            return None
        text = self.text(seq)
        if not seq.is_finished and seq.params.stop:
            # hold back what a stop string completed later could still cut away
            text = text[:max(0, len(text) - max(len(x) for x in seq.params.stop) + 1)]
        lps = []
        if seq.params.logprobs is not None:
            lps = [seq.logprobs[i] for i in range(sent_tokens, len(out))
                   if i < len(seq.logprobs)]
        result = EngineOutput(seq.request_id, new, text[sent_text:], lps)
        self._sent[seq.seq_id] = (len(out), max(sent_text, len(text)))
        if seq.is_finished:
            result.finish_reason, result.stop_reason = seq.finish_reason, seq.stop_reason
            result.num_prompt_tokens = seq.num_prompt_tokens
            result.num_output_tokens = len(out)
            result.num_cached_tokens = seq.num_prefix_hit_tokens
            self.forget(seq)
        return result

    def update(self, seq: Sequence) -> str | None:
        """Detokenize the tokens `seq` gained; returns the stop string it hit, if any.
        The text is cut before the stop string (vLLM's default)."""
        if self.tokenizer is None:
            return None
        d = self._detok.get(seq.seq_id)
        if d is None:
            d = self._detok[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.params.skip_special_tokens)
        seen = self._seen.get(seq.seq_id, 0)
        new_ids = seq.output_token_ids[seen:]
        self._seen[seq.seq_id] = seen + len(new_ids)
        if len(new_ids) <= 1:
            return self._add(seq, d, new_ids, seq.is_finished)
        # Several tokens in one step (speculative decoding): one at a time, so that a stop
        # string completed by an early token drops the later ones, as plain decoding would.
        for i, token in enumerate(new_ids):
            last = i == len(new_ids) - 1
            stop = self._add(seq, d, [token], last and seq.is_finished)
            if stop is not None:
                drop = len(new_ids) - 1 - i
                if drop:
                    del seq.token_ids[-drop:]
                    del seq.logprobs[seq.num_output_tokens:]
                    self._seen[seq.seq_id] -= drop
                return stop
        return None

    @staticmethod
    def _add(seq: Sequence, d: IncrementalDetokenizer, new_ids: list[int],
             final: bool) -> str | None:
        new_text = d.add(new_ids)
        if final:
            new_text += d.flush()
        return d.cut_at_stop(new_text, seq.params.stop)

    def text(self, seq: Sequence) -> str:
        d = self._detok.get(seq.seq_id)
        return d.text if d is not None else ""

    def forget(self, seq: Sequence) -> None:
        self._detok.pop(seq.seq_id, None)
        self._seen.pop(seq.seq_id, None)
        self._sent.pop(seq.seq_id, None)


def make_output(seq: Sequence, prompt: str | None, text: str) -> RequestOutput:
    """The offline API's result for a sequence, with the text its outputs carried."""
    lps = seq.logprobs if seq.params.logprobs is not None else None
    cum = None
    if lps:
        cum = sum(entry.logprob for entry in lps)
    completion = CompletionOutput(0, text, seq.output_token_ids, lps, cum,
                                  seq.finish_reason, seq.stop_reason)
    return RequestOutput(seq.request_id, prompt, seq.prompt_token_ids, [completion],
                         seq.is_finished, seq.num_prefix_hit_tokens)
