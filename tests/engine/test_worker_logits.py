"""The worker hands the Sampler the LM head's logits in the model's dtype
(engine/worker.py, engine/models/decoder.py `logits(..., float32=False)`): a bf16 greedy
batch is argmaxed on its bf16 rows (no [rows, vocab] float32 copy), and a batch that needs
float32 (sampling, logprobs) is widened by the Sampler. Either way the tokens and logprobs
are those of the widened logits."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, random_prompts


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama-hd64-gqa3", tmp_path_factory.mktemp("models"))[0]


def _spied_engine(folder, dtype: str):
    engine = LLMEngine(EngineConfig(model=str(folder), dtype=dtype, max_num_seqs=8,
                                    num_gpu_blocks=64))
    seen = []
    sampler = engine.worker.sampler

    def spy(logits, meta, *a, **k):
        out = sampler(logits, meta, *a, **k)
        seen.append((logits.clone(), meta, out))
        return out
    engine.worker.sampler = spy
    return engine, seen


def _run(engine, params: list[SamplingParams]) -> None:
    prompts = random_prompts(len(params), [5, 17, 33], engine.vocab_size, seed=3)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    while engine.has_unfinished():
        engine.run_once()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_batch_is_argmaxed_on_the_models_own_logits(folder, dtype):
    engine, seen = _spied_engine(folder, dtype)
    _run(engine, [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 3)
    assert seen, "the sampler never ran"
    for logits, _, out in seen:
        assert logits.dtype == getattr(torch, dtype)
        assert torch.equal(out.next_tokens, logits.float().argmax(-1))


def test_sampled_rows_with_logprobs_widen_to_float32(folder):
    engine, seen = _spied_engine(folder, "bfloat16")
    _run(engine, [SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True),
                  SamplingParams(max_tokens=4, temperature=0.9, seed=5, ignore_eos=True)])
    for logits, meta, out in seen:
        assert logits.dtype == torch.bfloat16
        assert out.logprobs is not None and out.logprobs.dtype == torch.float32
        raw = torch.log_softmax(logits.float(), dim=-1)
        want = raw.gather(1, out.next_tokens.unsqueeze(1)).squeeze(1)
        assert torch.equal(out.logprobs, want)
        greedy = meta.temperature == 0
        assert greedy.any()
        assert torch.equal(out.next_tokens[greedy], logits[greedy].float().argmax(-1))
