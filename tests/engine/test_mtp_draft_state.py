"""Each decode step's first draft is made from the newest verified hidden state, with the
draft's K/V of every verified position: after an accepted run (bonus token included), after
a rejection, after a partly accepted run. The reference is what a fresh prefill of the
same context drafts (the prefill runs the draft over every prompt position with the
target's own hidden states: the teacher-forced draft), so equal logits mean the decode
path lost nothing: no stale draft K/V, no older hidden state, no skipped position.

The reference engine keeps its prefix cache across its requests, so its prefills reuse
blocks that earlier, finished requests left behind, with their draft K/V: equality also
needs every finished sequence to leave the draft K/V of all its positions (finish_drafts)
and no position to be skipped when a step had no room to draft (the rows stay pending).
Without either, these tests fail."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import LLM, SamplingParams
from tests.tiny_models import make_tiny_model, random_prompts
from tests.tiny_mtp import with_mtp

MAX_NEW = 24
_IDS = itertools.count()
OPTS = dict(dtype="float32", block_size=4, num_gpu_blocks=128)


@pytest.fixture(scope="module", params=[(), (0,)], ids=["final-hidden", "aux-layers"])
def folder(tmp_path_factory, request):
    """A head on the target's final hidden state, and one that also reads layer 0's
    residual stream (its draft input is computed at every verify too)."""
    root = tmp_path_factory.mktemp("mtp-draft-state")
    base, _ = make_tiny_model("qwen3-qknorm-hd24", root)
    return with_mtp(base, root / "qwen3-mtp", aux_layers=request.param)


def _greedy(max_tokens=MAX_NEW):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class FirstStepLogits:
    """Wraps an MTPWorker (one sequence at a time): records the draft's first-step logits
    [V] by the sequence's tokens when it drafted, then (optionally) replaces the drafts
    with scripted ones so a test controls which are accepted."""

    def __init__(self, worker, script=None):
        self.worker, self.script, self.seen, self.steps = worker, script, {}, 0
        self.real_propose, self.real_logits = worker.propose, worker.draft.logits
        worker.propose, worker.draft.logits = self.propose, self.logits
        self._first = False

    def logits(self, hidden, selected=None):
        out = self.real_logits(hidden, selected)
        if self._first:
            assert out.shape[0] == 1, "one sequence at a time"
            self._ctx_logits = out[0].clone()
            self._first = False
        return out

    def propose(self, seqs, num_drafts):
        self._first, self._ctx_logits = True, None
        drafts, probs = self.real_propose(seqs, num_drafts)
        if num_drafts[0]:
            self.seen[tuple(seqs[0].token_ids)] = self._ctx_logits
        if self.script is not None and num_drafts[0]:
            drafts, probs = self.script(seqs[0], num_drafts[0], self.steps)
        self.steps += 1
        return drafts, probs


def oracle_script(continuation: list[int], vocab: int):
    """Drafts from the plain greedy continuation, by step: all right (every draft and the
    bonus accepted), the first wrong, only the first right."""
    def script(seq, k, step):
        d = continuation[seq.num_output_tokens:seq.num_output_tokens + k]
        if step % 3 == 1:
            d = [(d[0] + 1) % vocab] + d[1:]
        elif step % 3 == 2 and k > 1:
            d = d[:1] + [(t + 1) % vocab for t in d[1:]]
        probs = torch.zeros(1, k, vocab)
        for j, t in enumerate(d):
            probs[0, j, t] = 1.0
        return [d], probs
    return script


def reference_first_logits(llm: LLM, context: tuple[int, ...]) -> torch.Tensor:
    """The first-step draft logits after a fresh prefill of context[:-1] whose sampled
    token is context[-1] (the teacher-forced draft for the token after `context`)."""
    eng = llm.engine
    rec = FirstStepLogits(eng.speculative)
    try:
        seq = eng.add_request(f"ref{next(_IDS)}", list(context[:-1]), _greedy(3))
        eng.step()                               # prefill: samples context[-1]
        assert seq.output_token_ids == [context[-1]]
        eng.step()                               # first decode step drafts
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.speculative.propose, eng.speculative.draft.logits = (rec.real_propose,
                                                                 rec.real_logits)
    return rec.seen[tuple(context)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("scripted", [False, True], ids=["own-drafts", "accept-reject"])
def test_every_step_drafts_from_the_newest_verified_state(folder, k, scripted):
    prompts = random_prompts(2, [5, 13], 320, seed=7)
    plain = LLM(folder, **OPTS).generate([{"prompt_token_ids": p} for p in prompts],
                                         _greedy())
    spec = LLM(folder, speculative_method="mtp", num_speculative_tokens=k, **OPTS)
    ref = LLM(folder, speculative_method="mtp", num_speculative_tokens=1, **OPTS)
    vocab = spec.engine.model_config.vocab_size
    accepted_runs = 0
    for i, (p, out) in enumerate(zip(prompts, plain, strict=True)):
        cont = out.outputs[0].token_ids
        eng = spec.engine
        rec = FirstStepLogits(eng.speculative,
                              oracle_script(cont, vocab) if scripted else None)
        seq = eng.add_request(f"r{i}", p, _greedy())
        with_room = 0          # decode steps with room for a draft (2+ tokens to go)
        while eng.has_unfinished():
            before, out_before = len(seq), seq.num_output_tokens
            eng.step()
            if out_before:
                with_room += out_before <= MAX_NEW - 2
                accepted_runs += len(seq) - before > 1
        assert seq.output_token_ids == cont
        assert len(rec.seen) == with_room, "every decode step with room must draft"
        for ctx in sorted(rec.seen, key=len):
            want = reference_first_logits(ref, ctx)
            torch.testing.assert_close(rec.seen[ctx], want, rtol=1e-4, atol=1e-4,
                                       msg=f"the draft after {len(ctx)} tokens")
        eng.speculative.propose, eng.speculative.draft.logits = (rec.real_propose,
                                                                 rec.real_logits)
    if scripted:
        assert accepted_runs > 0, "the script must produce accepted runs (bonus positions)"
