"""The one logprob entry type through the engine: exactly k alternatives per token (the
sampled token among them only when it ranks there), descending, consistent with the
token's own logprob, and unchanged by the wire conversion."""

from __future__ import annotations

import pytest

from cluster.proto_convert import logprobs_from_proto, logprobs_to_proto
from engine import LLM, SamplingParams
from tests.tiny_models import make_tiny_model, random_prompts


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder, hf = make_tiny_model("llama-tied-gqa", tmp_path_factory.mktemp("models"))
    return LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=128), hf.config.vocab_size


@pytest.mark.parametrize("k", [0, 1, 3])
def test_entries_have_exactly_k_alternatives(llm, k):
    engine, vocab = llm
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, [3, 7, 12, 5], vocab, seed=k)]
    # hot sampling so the sampled token often falls outside the top k
    params = SamplingParams(max_tokens=10, temperature=3.0, seed=11, logprobs=k)
    outside = 0
    for out in engine.generate(prompts, params):
        comp = out.outputs[0]
        assert [e.token_id for e in comp.logprobs] == comp.token_ids
        for e in comp.logprobs:
            assert len(e.top) == k
            values = [v for _, v in e.top]
            assert values == sorted(values, reverse=True)
            ranked = dict(e.top)
            if e.token_id in ranked:
                assert ranked[e.token_id] == e.logprob
            else:
                outside += 1
                assert not values or e.logprob <= values[-1]
        assert comp.cumulative_logprob == pytest.approx(sum(e.logprob for e in comp.logprobs))
    if k == 1:
        assert outside > 0, "temperature 3 never sampled outside the top 1: test is vacuous"


def test_wire_round_trip_keeps_every_field(llm):
    engine, vocab = llm
    out = engine.generate([{"prompt_token_ids": random_prompts(1, [6], vocab)[0]}], SamplingParams(
        max_tokens=5, temperature=0.0, logprobs=2))[0].outputs[0]
    back = logprobs_from_proto(logprobs_to_proto(out.logprobs))
    assert [(e.token_id, [t for t, _ in e.top]) for e in back] == \
        [(e.token_id, [t for t, _ in e.top]) for e in out.logprobs]
    # the wire carries float32 (proto `float`)
    assert [e.logprob for e in back] == pytest.approx([e.logprob for e in out.logprobs],
                                                      rel=1e-6)
