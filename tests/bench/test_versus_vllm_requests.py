"""The requests the vLLM comparison hands each engine (bench/versus_vllm.py ->
bench/engine_runner.py): greedy workloads stay greedy, the sampled one carries its
temperature and top-p (no seed: vLLM's CPU worker fails on one), and both engines'
SamplingParams get the same keywords, always ignore_eos; a seed, where a spec has one,
goes through."""

from __future__ import annotations

from bench import engine_runner, versus_vllm
from bench.common import random_requests
from engine import SamplingParams


def _specs(workload: str) -> list[dict]:
    n, prompts, outputs, seed = versus_vllm.WORKLOADS[workload]
    reqs = random_requests(n, prompts, outputs, 1000, seed=seed)
    return [versus_vllm.request_spec(workload, r) for r in reqs]


def test_greedy_workloads_carry_no_sampling_fields():
    for w in ("mixed", "uniform", "short"):
        for spec in _specs(w):
            kw = engine_runner.sampling(spec)
            assert kw == {"max_tokens": spec["max_tokens"], "temperature": 0.0,
                          "ignore_eos": True}


def test_the_sampled_workload_samples_and_both_engines_take_the_keywords():
    temperature, top_p = versus_vllm.SAMPLED["sampled"]
    for spec in _specs("sampled"):
        kw = engine_runner.sampling(spec)
        assert kw == {"max_tokens": spec["max_tokens"], "temperature": temperature,
                      "top_p": top_p, "ignore_eos": True}
        params = SamplingParams(**kw)      # pdserve's; vLLM's take the same names
        assert params.temperature == temperature and params.seed is None
    seeded = engine_runner.sampling({"max_tokens": 4, "temperature": 1.0, "seed": 9})
    assert SamplingParams(**seeded).seed == 9
