"""Greedy tokens identical to HF transformers' generate, logprobs within 1e-3, on random
tiny Llama / Qwen2 / Qwen3 models, through every scheduling path: plain batches, prefix
cache hits, chunked prefill, preemption, and requests joining mid-run. fp32 on CPU."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from tests.tiny_models import CONFIGS, hf_greedy, make_tiny_model, random_prompts

MAX_NEW = 12
LENGTHS = [1, 3, 4, 5, 9, 16, 17, 31, 40]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    folder, hf = make_tiny_model(request.param, tmp_path_factory.mktemp("models"))
    return folder, hf


def _check(outs, prompts, hf, max_new=MAX_NEW, logprobs=True):
    for i, (out, prompt) in enumerate(zip(outs, prompts, strict=True)):
        ref_tokens, ref_lps = hf_greedy(hf, prompt, max_new)
        got = out.outputs[0].token_ids
        assert got == ref_tokens, f"prompt {i} (len {len(prompt)}): {got} != HF {ref_tokens}"
        if logprobs:
            entries = out.outputs[0].logprobs
            assert [e.token_id for e in entries] == got
            # greedy with logprobs=1: the one top entry is the sampled token itself
            assert [e.top for e in entries] == [((e.token_id, e.logprob),) for e in entries]
            lps = [e.logprob for e in entries]
            assert lps == pytest.approx(ref_lps, abs=1e-3), f"prompt {i} logprobs"


def _greedy(max_new=MAX_NEW, **kw):
    return SamplingParams(max_tokens=max_new, temperature=0.0, logprobs=1, **kw)


def test_batch_of_mixed_lengths(tiny):
    folder, hf = tiny
    llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=256)
    prompts = random_prompts(10, LENGTHS, hf.config.vocab_size, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _check(outs, prompts, hf)
    assert llm.stats()["free_blocks"] == 255        # every block came back


def test_prefix_cache_hits(tiny):
    folder, hf = tiny
    llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=256)
    shared = random_prompts(1, [13], hf.config.vocab_size, seed=2)[0]
    tails = random_prompts(8, [1, 2, 5, 8], hf.config.vocab_size, seed=3)
    prompts = [shared + t for t in tails] + [shared[:8], shared[:12]]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], _greedy())
    hits_before = llm.stats()["prefix_cache_hits"]
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    assert llm.stats()["prefix_cache_hits"] > hits_before
    _check(first + rest, prompts[:1] + prompts, hf)


def test_prefix_cache_off_gives_same_tokens(tiny):
    folder, hf = tiny
    prompts = random_prompts(6, [8, 12, 20], hf.config.vocab_size, seed=4) * 2
    llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=256,
              enable_prefix_caching=False)
    _check(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()), prompts, hf)
    assert llm.stats()["prefix_cache_hits"] == 0


def test_chunked_prefill(tiny):
    folder, hf = tiny
    llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=256,
              max_num_batched_tokens=7)
    prompts = random_prompts(8, [30, 2, 17, 40], hf.config.vocab_size, seed=5)
    _check(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy()), prompts, hf)


def test_preemption_with_tiny_pool(tiny):
    folder, hf = tiny
    llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=24)
    prompts = random_prompts(8, [9, 14, 20, 6], hf.config.vocab_size, seed=6)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_new=20))
    assert llm.stats()["preemptions"] > 0
    _check(outs, prompts, hf, max_new=20)
    assert llm.stats()["free_blocks"] == 23


def test_requests_join_and_leave_mid_run(tiny):
    folder, hf = tiny
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", block_size=4,
                                    num_gpu_blocks=128))
    prompts = random_prompts(9, LENGTHS, hf.config.vocab_size, seed=7)
    budgets = [3, 12, 7, 12, 1, 9, 12, 5, 12]
    seqs = {}
    finished: set[int] = set()
    joined_mid_run = left_mid_run = 0       # while other requests were running
    for step in range(200):
        if step % 3 == 0 and len(seqs) < len(prompts):      # a new request every 3 steps
            i = len(seqs)
            joined_mid_run += engine.has_unfinished()
            seqs[i] = engine.add_request(f"r{i}", prompts[i], _greedy(max_new=budgets[i]))
        engine.step()
        newly = {i for i, s in seqs.items() if s.is_finished} - finished
        finished |= newly
        left_mid_run += len(newly) if engine.has_unfinished() else 0
        if len(seqs) == len(prompts) and not engine.has_unfinished():
            break
    assert joined_mid_run >= 6 and left_mid_run >= 6      # 7 and 7 of the 9
    for i, seq in seqs.items():
        ref, _ = hf_greedy(hf, prompts[i], budgets[i])
        assert seq.output_token_ids == ref, f"request {i}"


def test_decode_width_groups(tiny, monkeypatch):
    """Decode rows cut into width groups (every cut allowed) attend exactly as one group."""
    from engine.layers import decode_plan

    # groups are the torch path's: the user's switch, read when the engine is built
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION_KERNEL", "0")
    monkeypatch.setattr(decode_plan, "GROUP_COST_BLOCKS", 0)
    seen = []
    build = decode_plan.build_plan
    monkeypatch.setattr("engine.layers.sdpa_attention.build_plan",
                        lambda *a: seen.append(build(*a)) or seen[-1])
    folder, hf = tiny
    llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=256)
    prompts = random_prompts(10, LENGTHS, hf.config.vocab_size, seed=7)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _check(outs, prompts, hf)
    assert not llm.engine.model.kernels.cpu_attention_kernel
    assert seen and max(len(plan) for plan in seen) == decode_plan.MAX_GROUPS
