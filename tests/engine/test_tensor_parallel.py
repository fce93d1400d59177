"""Tensor parallel on CPU with gloo (engine/parallel/): LLM(tensor_parallel_size=2) runs
rank 1 in a process of its own, every forward in lockstep, and gives the tokens of
tensor_parallel_size=1.

Tolerance: the row-parallel layers add two partial sums where one rank's matmul adds the
whole row in its own order; float32 then differs by a few ulps of the partial sums per
layer (2 layers here, values O(1): ~1e-6), carried to the logprobs without growth beyond a
few-fold. Logprobs must agree within 1e-4 (measured: under 1e-6), and greedy tokens
exactly up to the first step whose top-2 margin (in the TP = 1 run) is under that: past
such a near-tie either token is a correct greedy choice."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.parallel.shard import ExpertParallel
from tests.tiny_models import make_tiny_model, random_prompts

TOL = 1e-4
OPTS = dict(dtype="float32", block_size=4, num_gpu_blocks=128)


def _exact_prefix(ref) -> int:
    """Steps of a TP = 1 output before its first near-tie."""
    for i, lp in enumerate(ref.logprobs):
        top = [v for _, v in lp.top]
        if len(top) > 1 and top[0] - top[1] < TOL:
            return i
    return len(ref.token_ids)


# qwen2-gqa4: 1 KV head for 2 ranks (a copy each); llama-untied: biases on o_proj and the
# MLP (added after the all-reduce); qwen3: q/k norms per head; qwen3-moe: 8 experts, 4 a
# rank (EP = 2) or all 8 on each (EP = 1), its first layer dense; deepseek: MLA's heads
# split, its latent cache whole on each rank, DeepSeekMoE's experts split
@pytest.mark.parametrize("name,ep", [("qwen2-gqa4", 1), ("llama-untied-hd32-llama3rope", 1),
                                     ("qwen3-qknorm-hd24", 1), ("qwen3-moe-e8k2", 2),
                                     ("qwen3-moe-e8k2", 1), ("deepseek-v3-mla", 2)])
def test_tp2_gives_the_tokens_and_logprobs_of_tp1(tmp_path_factory, name, ep):
    folder = make_tiny_model(name, tmp_path_factory.mktemp("models"))[0]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, [3, 9, 17, 30], 320, 11)]
    prompts.append({"prompt_token_ids": prompts[3]["prompt_token_ids"][:20] + [7, 8]})
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)
    ref = [o.outputs[0] for o in LLM(str(folder), **OPTS).generate(prompts, params)]
    llm = LLM(str(folder), **OPTS, tensor_parallel_size=2, expert_parallel_size=ep)
    try:
        attn = llm.engine.model.layers[0].self_attn
        assert attn.num_heads == 2
        assert llm.engine.kv_cache.num_kv_heads == getattr(attn, "num_kv_heads", 1)
        model = llm.engine.model                          # vocabulary-parallel ends
        assert model.embed_tokens.weight.shape[0] == model.config.vocab_size // 2
        assert model.lm_head.weight.shape[0] == model.config.vocab_size // 2
        assert (model.lm_head.weight is model.embed_tokens.weight) == \
            model.config.tie_word_embeddings
        sparse = [x.mlp for x in llm.engine.model.layers if isinstance(x.mlp, ExpertParallel)]
        assert all(m.block.experts.local.gate_up_proj.shape[0] == 4 for m in sparse)
        assert bool(sparse) == (ep == 2)          # EP = 1: every expert on every rank
        assert all(x.block.experts.local.gate_up_proj.shape[0] == 4 for x in sparse)
        got = [o.outputs[0] for o in llm.generate(prompts, params)]    # prefix hit too
    finally:
        llm.engine.close()
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        n = _exact_prefix(a)
        assert b.token_ids[:n] == a.token_ids[:n], f"prompt {i}"
        for la, lb in zip(a.logprobs[:n], b.logprobs[:n], strict=True):
            assert [v for _, v in lb.top] == pytest.approx([v for _, v in la.top], abs=TOL)


def test_what_it_cannot_shard_is_named_before_any_rank_starts(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    moe = make_tiny_model("qwen3-moe-e8k2", root)[0]
    with pytest.raises(ValueError, match="8 experts do not divide among "
                                         "tensor_parallel_size 3"):
        LLMEngine(EngineConfig(model=str(moe), **OPTS, tensor_parallel_size=3,
                               expert_parallel_size=3))
    dense = make_tiny_model("qwen3-qknorm-hd24", root)[0]
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by "
                                         "tensor_parallel_size 3"):
        LLMEngine(EngineConfig(model=str(dense), **OPTS, tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(model=str(dense), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="expert_parallel_size must be 1 or "
                                         "tensor_parallel_size"):
        EngineConfig(model=str(moe), tensor_parallel_size=2, expert_parallel_size=4)
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig(model=str(dense), tensor_parallel_size=2, enable_graph=True)


def test_a_lost_rank_is_named_and_stops_the_engine(tmp_path_factory):
    """A rank process that dies: the watcher names it at once (on_lost, which a node uses
    to exit and leave discovery) and the next step raises instead of waiting on a
    collective that cannot complete."""
    import os
    import signal
    import threading

    folder = make_tiny_model("qwen2-gqa4", tmp_path_factory.mktemp("models"))[0]
    llm = LLM(str(folder), **OPTS, tensor_parallel_size=2)
    lost = threading.Event()
    why: list[str] = []
    ranks = llm.engine.ranks
    ranks.on_lost = lambda reason: (why.append(reason), lost.set())
    params = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0].token_ids
        os.kill(ranks.procs[0].pid, signal.SIGKILL)
        assert lost.wait(60), "the watcher did not see the rank die"
        assert "pdserve-tp-rank1 exited" in why[0]
        with pytest.raises(RuntimeError, match="pdserve-tp-rank1 exited"):
            llm.generate([{"prompt_token_ids": [5, 6, 8]}], params)
    finally:
        llm.engine.close()


def test_a_rank_started_apart_joins_over_tcp(tmp_path_factory):
    """A multi-host group's shape on loopback: rank 1 is `pdserve tp-rank`, its own
    process started apart, joining rank 0's TCP rendezvous (tensor_parallel_store); the
    tokens are TP = 1's, and the rank exits 0 when the engine closes."""
    import subprocess
    import sys
    from pathlib import Path

    from launch.etcd_server import free_port

    folder = make_tiny_model("qwen3-qknorm-hd24", tmp_path_factory.mktemp("models"))[0]
    store = f"127.0.0.1:{free_port()}"
    root = Path(__file__).resolve().parents[2]
    rank = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "tp-rank", "--rank", "1", "--model", str(folder),
         "--dtype", "float32", "--block-size", "4", "--tensor-parallel-size", "2",
         "--tensor-parallel-store", store], cwd=root, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [5, 17], 320, 3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    try:
        ref = [o.outputs[0] for o in LLM(str(folder), **OPTS).generate(prompts, params)]
        llm = LLM(str(folder), **OPTS, tensor_parallel_size=2, tensor_parallel_store=store)
        got = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert llm.engine.ranks.procs == []            # nothing spawned here
        llm.engine.close()
        out, _ = rank.communicate(timeout=60)
        assert rank.returncode == 0, out
    finally:
        if rank.poll() is None:
            rank.kill()
    for a, b in zip(ref, got, strict=True):
        n = _exact_prefix(a)
        assert b.token_ids[:n] == a.token_ids[:n]
