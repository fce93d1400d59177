"""Batch-invariant mode (EngineConfig.batch_invariant): a request's tokens do not depend
on what runs beside it, how its prompt is chunked or whether its prefix was cached, in
bfloat16 too; and the mode is still exact (greedy equal to HF in float32)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.layers import batch_invariant
from engine.layers.linear import Linear
from tests.tiny_models import hf_greedy, make_tiny_model, random_prompts

PREFIX = ("You are a helpful assistant who writes careful, vivid and concise prose for "
          "readers of all ages, in plain English, with no lists. ")
TOPICS = ["a cat", "the sea", "a robot", "winter", "a lost key", "the moon", "bread", "fire"]
PROMPTS = [PREFIX + f"Write a short story about {t}:" for t in TOPICS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gives_a_row_the_same_bits_for_any_row_count(dtype):
    gen = torch.Generator().manual_seed(1)
    m = Linear(96, 200, bias=True).to(dtype)
    m.batch_invariant = True
    m.row_multiple = batch_invariant.measure_row_multiple(m.weight, gen)
    x = torch.randn(40, 96, generator=gen).to(dtype)
    with torch.inference_mode():
        ref = m(x[:1])[0]
        for n in range(2, 41):
            y = m(x[:n])
            assert torch.equal(y[0], ref), f"first of {n} rows"
            for r in range(1, n):
                assert torch.equal(y[r], m(x[r:r + 1])[0]), f"row {r} of {n}"


def test_config_refuses_what_the_mode_cannot_hold():
    with pytest.raises(ValueError, match="cpu only"):
        EngineConfig(model="m", device="cuda", batch_invariant=True)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model="m", batch_invariant=True, speculative_method="mtp")


def test_float32_mode_is_still_exact(tmp_path):
    folder, hf = make_tiny_model("qwen3-qknorm-hd24", tmp_path)
    llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=256,
              max_num_batched_tokens=8, batch_invariant=True)     # prompts split in chunks
    prompts = random_prompts(5, [3, 9, 17, 26, 40], hf.config.vocab_size, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10)[0]


def _greedy(llm, prompts):
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


def test_bf16_tokens_do_not_depend_on_batch_chunking_or_cache(default_model_dir):
    solo = LLM(default_model_dir, dtype="bfloat16", enable_prefix_caching=False,
               batch_invariant=True)
    ref = [_greedy(solo, [p])[0] for p in PROMPTS]
    del solo
    busy = LLM(default_model_dir, dtype="bfloat16", max_num_batched_tokens=48,
               batch_invariant=True)
    assert busy.engine.config.enable_prefix_caching
    first = _greedy(busy, PROMPTS)                   # all at once, prompts chunked
    again = _greedy(busy, PROMPTS[::-1])[::-1]       # the shared prefix now cached
    assert busy.stats()["prefix_cache_hits"] > 0
    assert first == ref
    assert again == ref


def test_bf16_pd_streams_equal_alone_and_concurrent(default_model_dir):
    from engine.tokenizer import load_tokenizer
    from tests.unit.pd_harness import PdPair
    ids = [load_tokenizer(str(default_model_dir)).encode(p) for p in PROMPTS]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    opts = dict(dtype="bfloat16", batch_invariant=True, max_num_batched_tokens=64,
                num_gpu_blocks=256)

    async def run():
        pair = PdPair(default_model_dir, dict(opts), dict(opts))
        pair.start()
        try:
            alone = [(await pair.generate(f"a{i}", p, sp))[0] for i, p in enumerate(ids)]
            together = await asyncio.gather(*[pair.generate(f"b{i}", p, sp)
                                              for i, p in enumerate(ids)])
        finally:
            await pair.stop()
        return alone, [t[0] for t in together]

    alone, together = asyncio.run(run())
    assert together == alone
