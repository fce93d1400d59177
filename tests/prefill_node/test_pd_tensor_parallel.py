"""PD between tensor-parallel layouts: a TP = 2 prefill node pushing to a TP = 1 decode
node and the reverse (engine/parallel/tp_kv_cache.py). The push carries every KV head
whatever either side's split (a prefill node's ranks gather theirs to rank 0, a decode
node's rank 0 hands each rank its heads before the next forward), so the tokens are a
single node's; tensor parallel's sums differ from one rank's within the tolerance of
tests/engine/test_tensor_parallel.py, so tokens are compared up to a near-tie."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from tests.engine.test_tensor_parallel import TOL, _exact_prefix
from tests.pd_harness import PdPair
from tests.tiny_models import make_tiny_model, random_prompts

OPTS = dict(dtype="float32", block_size=4, num_gpu_blocks=96, max_num_seqs=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("qwen3-qknorm-hd24", tmp_path_factory.mktemp("models"))[0]


@pytest.fixture(scope="module")
def mla_folder(tmp_path_factory):
    return make_tiny_model("deepseek-v3-mla", tmp_path_factory.mktemp("models"))[0]


@pytest.mark.parametrize("model,prefill_tp,decode_tp,tcp", [
    ("gqa", 2, 1, False), ("gqa", 1, 2, False), ("gqa", 2, 2, True),
    ("mla", 2, 1, True), ("mla", 1, 2, False)],
    ids=["2-to-1", "1-to-2", "2-to-2-tcp", "mla-2-to-1-tcp", "mla-1-to-2"])
def test_pd_between_tensor_parallel_layouts_gives_a_single_nodes_tokens(
        folder, mla_folder, model, prefill_tp, decode_tp, tcp):
    """mla: DeepSeek-V3, whose latent cache every rank keeps whole (its heads split only in
    the query and kv_b_proj), so the push is the same latent rows from any layout."""
    folder = mla_folder if model == "mla" else folder
    prompts = random_prompts(5, [3, 9, 17, 30], 320, seed=13)
    prompts.append(prompts[3][:20] + [7, 8])          # a decode-side prefix hit
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
    ref = [o.outputs[0] for o in
           LLM(folder, **OPTS).generate([{"prompt_token_ids": p} for p in prompts], params)]

    async def main():
        pair = PdPair(folder, {**OPTS, "tensor_parallel_size": prefill_tp},
                      {**OPTS, "tensor_parallel_size": decode_tp}, 30.0, tcp=tcp)
        pair.start()
        try:
            outs = await asyncio.gather(*[pair.generate(f"r{i}", p, params)
                                          for i, p in enumerate(prompts[:-1])])
            outs.append(await pair.generate("last", prompts[-1], params))
        finally:
            await pair.stop()
            for node in (pair.prefill, pair.decode):
                node.engine.close()
        return outs
    outs = asyncio.run(main())
    for i, ((tokens, lps, _), want) in enumerate(zip(outs, ref, strict=True)):
        n = _exact_prefix(want)
        assert tokens[:n] == want.token_ids[:n], f"prompt {i}"
        assert [e.logprob for e in lps[:n]] == pytest.approx(
            [e.logprob for e in want.logprobs[:n]], abs=TOL)
