"""`LLM(..., enable_graph=True)` end to end on CPU: the same tokens as with graphs off on
random-weight models and the default model, every eager fallback counted by its reason,
min_decoding_batch_size, padding off, explicit buckets, warm-up captures, the capture
lock around prepare, and the stats."""

from __future__ import annotations

import threading

import pytest

from engine import LLM, SamplingParams
from engine.executor.graph_buckets import GraphKey
from tests.tiny_models import CONFIGS, make_tiny_model, random_prompts

LENGTHS = [1, 3, 5, 9, 16, 17, 31, 40, 2, 64]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(name, root)[0] for name in sorted(CONFIGS)}


def _prompts(n: int, lengths=LENGTHS, seed: int = 0):
    return [{"prompt_token_ids": p} for p in random_prompts(n, lengths, 320, seed=seed)]


def _params(n: int, base: int = 6):
    # different lengths: sequences finish at different steps, so batch sizes vary
    return [SamplingParams(max_tokens=base + (i * 5) % 13, temperature=0.0, logprobs=1,
                           ignore_eos=True) for i in range(n)]


def _run(folder, prompts, params, **opts):
    llm = LLM(folder, dtype="float32", **opts)
    outs = llm.generate(prompts, params)
    return [o.outputs[0] for o in outs], llm


def _same_outputs(got, ref):
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for g, r in zip(got, ref, strict=True):
        for eg, er in zip(g.logprobs or [], r.logprobs or [], strict=True):
            assert (eg.token_id, [t for t, _ in eg.top]) == (er.token_id, [t for t, _ in er.top])
            assert [eg.logprob] + [v for _, v in eg.top] == pytest.approx(
                [er.logprob] + [v for _, v in er.top], abs=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_graph_tokens_equal_eager(models, name):
    prompts, params = _prompts(24), _params(24)
    opts = dict(max_num_seqs=12, block_size=8, num_gpu_blocks=400)
    ref, _ = _run(models[name], prompts, params, **opts)
    got, llm = _run(models[name], prompts, params, enable_graph=True, **opts)
    _same_outputs(got, ref)
    st = llm.stats()
    assert st["graph_replays"] > 0 and st["graph_captures"] >= 3
    assert st["graph_captures"] == len(llm.engine.worker.executor.graphs)
    assert set(st["graph_fallbacks"]) <= {"prefill", "chunked_prefill"}


def test_graph_with_prefix_hits_and_preemption(models):
    """Shared prefixes (cache hits) and a pool small enough to preempt: the graph
    engine's tokens still equal the eager engine's."""
    base = random_prompts(4, [9, 14, 20, 6], 320, seed=6)
    prompts = [{"prompt_token_ids": p} for p in base + [p + [7, 8] for p in base]]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 8
    opts = dict(block_size=4, num_gpu_blocks=28)
    ref, _ = _run(models["qwen2-gqa4"], prompts, params, **opts)
    got, llm = _run(models["qwen2-gqa4"], prompts, params, enable_graph=True, **opts)
    _same_outputs(got, ref)
    st = llm.stats()
    assert st["preemptions"] > 0 and st["prefix_cache_hits"] > 0 and st["graph_replays"] > 0


def test_stats_without_graphs(models):
    _, llm = _run(models["llama-tied-gqa"], _prompts(2), _params(2))
    st = llm.stats()
    assert (st["graph_captures"], st["graph_replays"], st["graph_fallbacks"]) == (0, 0, {})


def test_fallback_prefill_and_chunked_prefill(models):
    # a budget of 24 tokens: long prompts are chunked and share steps with decodes
    prompts, params = _prompts(6, [50, 3, 70, 4, 45, 2]), _params(6)
    opts = dict(max_num_seqs=6, max_num_batched_tokens=24)
    ref, _ = _run(models["qwen2-gqa4"], prompts, params, **opts)
    got, llm = _run(models["qwen2-gqa4"], prompts, params, enable_graph=True, **opts)
    _same_outputs(got, ref)
    fb = llm.stats()["graph_fallbacks"]
    assert fb["prefill"] >= 1 and fb["chunked_prefill"] >= 1
    assert llm.stats()["graph_replays"] > 0


def test_fallback_batch_too_large(models):
    prompts, params = _prompts(7), _params(7, base=4)
    ref, _ = _run(models["llama-tied-gqa"], prompts, params)
    got, llm = _run(models["llama-tied-gqa"], prompts, params, enable_graph=True,
                    graph_max_batch_size=4)
    _same_outputs(got, ref)
    st = llm.stats()
    assert st["graph_fallbacks"]["batch_too_large"] >= 1
    assert st["graph_replays"] > 0          # once few enough remain, they replay
    assert max(k.num_seqs for k in llm.engine.worker.executor.graphs) == 4


def test_fallback_seq_too_long(models):
    prompts = _prompts(3, [10, 20, 21])
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 3
    ref, _ = _run(models["qwen3-qknorm-hd24"], prompts, params)
    got, llm = _run(models["qwen3-qknorm-hd24"], prompts, params, enable_graph=True,
                    graph_max_seq_len=24, block_size=4)
    _same_outputs(got, ref)
    ex = llm.engine.worker.executor
    assert ex.buffers.width == 6
    st = llm.stats()
    # the batch replays while every KV length is <= 24, then goes eager
    assert st["graph_replays"] > 0 and st["graph_fallbacks"]["seq_too_long"] >= 1


def test_fallback_single_layer(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, initializer_range=0.05)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    prompts, params = _prompts(3), _params(3)
    ref, _ = _run(tmp_path, prompts, params)
    got, llm = _run(tmp_path, prompts, params, enable_graph=True)
    _same_outputs(got, ref)
    st = llm.stats()
    assert st["graph_captures"] == st["graph_replays"] == 0
    assert st["graph_fallbacks"]["single_layer"] == st["steps"]


def test_min_decoding_batch_size_with_buckets(models):
    prompts, params = _prompts(3), _params(3)
    ref, _ = _run(models["qwen2-gqa4"], prompts, params)
    got, llm = _run(models["qwen2-gqa4"], prompts, params, enable_graph=True,
                    min_decoding_batch_size=5)
    _same_outputs(got, ref)
    # every decode batch is padded to 5 rows by the builder, then to the bucket of 8
    assert set(llm.engine.worker.executor.graphs) == {GraphKey(8)}


def test_padding_off_one_graph_per_size(models):
    prompts = _prompts(5)
    params = [SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True)
              for i in range(5)]
    ref, _ = _run(models["llama-tied-gqa"], prompts, params)
    got, llm = _run(models["llama-tied-gqa"], prompts, params, enable_graph=True,
                    graph_padding=False)
    _same_outputs(got, ref)
    sizes = {k.num_tokens for k in llm.engine.worker.executor.graphs}
    assert sizes == {1, 2, 3, 4, 5}


def test_explicit_buckets(models):
    prompts, params = _prompts(7), _params(7, base=3)
    ref, _ = _run(models["llama-tied-gqa"], prompts, params)
    got, llm = _run(models["llama-tied-gqa"], prompts, params, enable_graph=True,
                    graph_batch_sizes=[6, 3])
    _same_outputs(got, ref)
    assert {k.num_tokens for k in llm.engine.worker.executor.graphs} <= {3, 6}
    assert llm.stats()["graph_fallbacks"]["batch_too_large"] >= 1   # 7 > 6


def test_warmup_captures_largest_first(models):
    llm = LLM(models["llama-tied-gqa"], dtype="float32", enable_graph=True,
              graph_warmup_batch_sizes=[1, 5, 16])
    ex = llm.engine.worker.executor
    assert list(ex.graphs) == [GraphKey(16), GraphKey(8), GraphKey(1)]
    assert llm.stats()["graph_captures"] == 3
    # the warm-up wrote to the padding block only
    for t in llm.engine.kv_cache.k + llm.engine.kv_cache.v:
        assert not t[:, 1:].any()      # [Hk, blocks, bs, D]: every block but 0
    prompts, params = _prompts(5), _params(5, base=3)   # batches of 5, 4, 3, 2, 1
    ref, _ = _run(models["llama-tied-gqa"], prompts, params)
    _same_outputs([o.outputs[0] for o in llm.generate(prompts, params)], ref)
    st = llm.stats()
    assert st["graph_captures"] == 5                  # buckets 4 and 2 were not warmed up
    assert {k.num_tokens for k in ex.graphs} == {16, 8, 4, 2, 1}
    assert st["graph_replays"] > 0


def test_prepare_holds_the_capture_lock_when_graphs_on(models):
    from engine.input_builder import BatchInputBuilder
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence

    for graphs_on in (True, False):
        llm = LLM(models["llama-tied-gqa"], dtype="float32", enable_graph=graphs_on)
        worker = llm.engine.worker
        seq = Sequence([5, 6, 7], SamplingParams())
        seq.block_table = [1]
        fi = BatchInputBuilder(16, 320).build_forward_input(SchedulerOutput([seq], [3]))
        done = threading.Event()

        def prepare(worker=worker, fi=fi, done=done):
            worker.prepare_work_before_execute(fi)
            done.set()

        with worker.device.capture_lock:          # as a capture in progress would
            t = threading.Thread(target=prepare)
            t.start()
            assert done.wait(0.3) is not graphs_on   # blocked only with graphs on
        t.join(5)
        assert done.is_set()


def test_default_model_graph_equals_eager(default_model_dir):
    prompts = ["The capital of France is", "def add(a, b):"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 3)]
    opts = dict(max_model_len=64, max_num_seqs=4)
    ref, _ = _run(default_model_dir, prompts, params, **opts)
    got, llm = _run(default_model_dir, prompts, params, enable_graph=True, **opts)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    st = llm.stats()
    assert st["graph_captures"] == 2 and st["graph_replays"] > 0   # buckets 2 and 1
