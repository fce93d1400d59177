"""The requests the vLLM comparison hands each engine (bench/versus_vllm.py ->
bench/engine_runner.py): greedy workloads stay greedy, the sampled one carries its
temperature, top-p and a seed per request, and both engines' SamplingParams get the same
keywords, always ignore_eos."""

from __future__ import annotations

from bench import engine_runner, versus_vllm
from bench.common import random_requests
from engine import SamplingParams


def _specs(workload: str) -> list[dict]:
    n, prompts, outputs, seed = versus_vllm.WORKLOADS[workload]
    reqs = random_requests(n, prompts, outputs, 1000, seed=seed)
    return [versus_vllm.request_spec(workload, i, r) for i, r in enumerate(reqs)]


def test_greedy_workloads_carry_no_sampling_fields():
    for w in ("mixed", "uniform", "short"):
        for spec in _specs(w):
            kw = engine_runner.sampling(spec)
            assert kw == {"max_tokens": spec["max_tokens"], "temperature": 0.0,
                          "ignore_eos": True}


def test_the_sampled_workload_seeds_each_request_and_both_engines_take_the_keywords():
    temperature, top_p = versus_vllm.SAMPLED["sampled"]
    specs = _specs("sampled")
    assert [s["seed"] for s in specs] == list(range(len(specs)))
    for spec in specs:
        kw = engine_runner.sampling(spec)
        assert kw["temperature"] == temperature and kw["top_p"] == top_p
        params = SamplingParams(**kw)      # pdserve's; vLLM's take the same names
        assert params.seed == spec["seed"] and params.ignore_eos
        assert params.max_tokens == spec["max_tokens"]
