"""The prefill node streams a prompt's first token the moment it is sampled, ahead of the
push's end, when that token cannot end the request; the decode node's stream repeats it.
Through the real node services in one process (tests/pd_harness.py)."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from tests.pd_harness import PdPair
from tests.tiny_models import make_tiny_model, random_prompts

OPTS = dict(dtype="float32", block_size=4, num_gpu_blocks=96, max_num_seqs=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama-tied-gqa", tmp_path_factory.mktemp("models"))[0]


def _run(folder, prompts, params, eos: frozenset[int] | None = None):
    """Each prompt through a PD pair, one at a time: (tokens, logprobs, finish), the early
    first token (or None) and how many decode-node events had come when it came. eos: the
    end-of-sequence ids both engines use instead of the model's."""
    async def main():
        pair = PdPair(folder, OPTS, OPTS)
        if eos is not None:
            pair.prefill.engine.eos_token_ids = pair.decode.engine.eos_token_ids = eos
        pair.start()
        results = []
        try:
            for i, prompt in enumerate(prompts):
                rid = f"r{i}"
                task = asyncio.ensure_future(pair.generate(rid, prompt, params))
                while rid not in pair.first_tokens and not task.done():
                    await asyncio.sleep(0)
                events_then = len(pair.token_events.get(rid, []))
                results.append((await task, pair.first_tokens.get(rid), events_then))
        finally:
            await pair.stop()
        return results
    return asyncio.run(main())


def test_the_first_token_comes_before_the_decode_stream_and_equals_its_first(folder):
    prompts = random_prompts(4, [2, 7, 16, 30], 320, seed=21)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    for i, ((tokens, lps, finish), first, events_then) in enumerate(
            _run(folder, prompts, params)):
        assert finish == "length" and len(tokens) == 6, f"prompt {i}"
        assert first is not None, f"prompt {i}: no first token streamed"
        assert events_then == 0, f"prompt {i}: the decode node's stream came first"
        assert first.token_id == tokens[0]
        assert first.logprob.token_id == tokens[0]
        assert first.logprob.logprob == lps[0].logprob
        assert [t.token_id for t in first.logprob.top] == [t for t, _ in lps[0].top]


def test_a_first_token_that_ends_the_request_is_not_streamed_ahead(folder):
    """max_tokens 1, a stop token id, the end-of-sequence token: the first token is the
    last, so only the decode node's stream carries it, with its finish."""
    prompt = random_prompts(1, [9], 320, seed=5)[0]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    [((tokens, _, _), first, _)] = _run(folder, [prompt], greedy)
    assert first is not None and first.token_id == tokens[0]
    ends = [SamplingParams(max_tokens=1, temperature=0.0),
            SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[tokens[0]])]
    for params, ((got, _, finish), first, _) in zip(
            ends, _run_ends(folder, prompt, ends), strict=True):
        assert first is None, f"{params}: streamed ahead a token that ends the request"
        assert got == tokens[:1]
        assert finish == ("length" if params.max_tokens == 1 else "stop")


def test_the_end_of_sequence_token_is_streamed_ahead_only_when_ignored(folder):
    prompt = random_prompts(1, [9], 320, seed=5)[0]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    [((tokens, _, _), _, _)] = _run(folder, [prompt], greedy)
    # the model's end-of-sequence token made equal to this prompt's first token
    eos = frozenset({tokens[0]})
    for ignore_eos in (False, True):
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=ignore_eos)
        [((got, _, finish), first, _)] = _run(folder, [prompt], params, eos=eos)
        if ignore_eos:
            assert first is not None and got == tokens and finish == "length"
        else:
            assert first is None and got == tokens[:1] and finish == "stop"


def _run_ends(folder, prompt, params_list):
    return [_run(folder, [prompt], p)[0] for p in params_list]
