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


# Where a forced candidate may legitimately not hold or not run (the CPU's property, not a
# bug): the weight-streaming GEMM needs AVX512-BF16, bf16 and a packable shape; the padded
# library call holds only where the library's kernels allow it. The fixed-order kernel and
# the automatic choice must hold on every CPU.
MAY_REFUSE = {"bf16_gemm": ("needs AVX512-BF16", "bf16 on CPU only", "not packable"),
              "padded": ("different bits",)}


def _enable(module: torch.nn.Module, choice: str) -> bool:
    """Put `module` in batch-invariant mode with `choice`; False when the candidate
    refused for a reason MAY_REFUSE allows (anything else fails the test)."""
    try:
        batch_invariant.enable(module, choice)
    except batch_invariant.NotBatchInvariant as exc:
        allowed = MAY_REFUSE.get(choice, ())
        assert any(a in str(exc) for a in allowed), f"{choice} must hold here: {exc}"
        return False
    return True


@pytest.mark.parametrize("out_features", [224, 200], ids=["packable", "not-packable"])
@pytest.mark.parametrize("choice", ["auto", *batch_invariant.CANDIDATES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gives_a_row_the_same_bits_for_any_row_count(dtype, choice, out_features):
    gen = torch.Generator().manual_seed(1)
    m = Linear(96, out_features, bias=True).to(dtype)
    if not _enable(m, choice):
        return
    assert m.invariant_name == choice or choice == "auto"
    x = torch.randn(40, 96, generator=gen).to(dtype)
    with torch.inference_mode():
        ref = m(x[:1])[0]
        for n in range(2, 41):
            y = m(x[:n])
            assert torch.equal(y[0], ref), f"first of {n} rows"
            for r in range(1, n):
                assert torch.equal(y[r], m(x[r:r + 1])[0]), f"row {r} of {n}"
        # and it computes the linear: float32 to summation-order error, bf16 to one rounding
        want = (x.double() @ m.weight.double().t() + m.bias.double())
        got = m(x).double()
        tol = 1e-4 if dtype == torch.float32 else 2 ** -7
        assert ((got - want).abs() <= tol * want.abs().clamp_min(1)).all()
        assert torch.equal(m(x[None])[0], got.to(dtype)), "a 3-D input: the same rows"


def test_the_fixed_order_kernel_holds_for_any_shape_and_dtype():
    """Property of the fallback that every CPU can take: rows alone equal rows in calls of
    any size, for odd shapes (tails of its 32-column blocks and 4-row groups)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from engine.layers import cpu_fixed_order_linear as fol

    @settings(max_examples=40, derandomize=True, database=None, deadline=None)
    @given(n=st.integers(1, 80), k=st.integers(1, 70), rows=st.integers(1, 13),
           bf16=st.booleans(), seed=st.integers(0, 1000))
    def check(n, k, rows, bf16, seed):
        gen = torch.Generator().manual_seed(seed)
        dtype = torch.bfloat16 if bf16 else torch.float32
        w = torch.randn(n, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        wt = fol.prepare(w)
        y = fol.linear(x, wt, b)
        for r in range(rows):
            assert torch.equal(fol.linear(x[r:r + 1], wt, b)[0], y[r])
        want = x.double() @ w.double().t() + b.double()
        tol = 1e-4 if dtype == torch.float32 else 2 ** -7
        assert ((y.double() - want).abs() <= tol * (want.abs() + k ** 0.5)).all()
    check()


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


@pytest.mark.parametrize("choice", ["auto", *batch_invariant.CANDIDATES])
def test_bf16_tokens_do_not_depend_on_batch_chunking_or_cache(default_model_dir, monkeypatch,
                                                              choice):
    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT_LINEAR", choice)
    try:
        solo = LLM(default_model_dir, dtype="bfloat16", enable_prefix_caching=False,
                   batch_invariant=True)
    except batch_invariant.NotBatchInvariant as exc:
        assert any(a in str(exc) for a in MAY_REFUSE.get(choice, ())), exc
        return
    kinds = {m.invariant_name for m in solo.engine.model.modules() if isinstance(m, Linear)}
    assert kinds == {choice} or choice == "auto"
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
    from tests.pd_harness import PdPair
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
