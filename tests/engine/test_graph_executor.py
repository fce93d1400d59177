"""The graph executor on CPU (engine/executor/graph.py): for every bucket up to 64 the
graph path gives the eager path's greedy tokens and (allclose) hidden states on the same
cache state; one capture per bucket key, replays afterwards over buffers that never move;
padding rows never touch a real block; the decode forward has no data-dependent shapes
or host syncs (it runs on the meta device, where such ops cannot)."""

from __future__ import annotations

import pytest
import torch

from engine.block_manager import PADDING_BLOCK_ID
from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.executor.graph import GraphExecutor
from engine.executor.graph_buckets import GraphKey
from engine.executor.graph_buffers import GraphBuffers
from engine.kv_cache import KVCache
from engine.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, random_prompts

# batch sizes landing in every bucket up to 64, exactly and with padding rows
SIZES = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 48, 50, 64]
# prompt lengths crossing block boundaries (block_size 16) during decode
LENGTHS = [1, 7, 15, 16, 30, 31, 47, 64, 3, 70]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("qwen3-qknorm-hd24", tmp_path_factory.mktemp("models"))[0]


def _engine(folder, **kw) -> LLMEngine:
    opts = dict(model=str(folder), dtype="float32", enable_graph=True, max_num_seqs=64,
                num_gpu_blocks=600)
    opts.update(kw)
    return LLMEngine(EngineConfig(**opts))


def _add(engine, n: int, max_tokens: int, seed: int = 0, lengths=LENGTHS):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(n, lengths, engine.vocab_size, seed=seed)):
        engine.add_request(f"s{seed}-{i}", p, sp)


def _prepared_step(engine):
    sched = engine.scheduler.schedule()
    fi = engine.builder.build_forward_input(sched)
    return sched, fi, engine.worker.prepare_work_before_execute(fi).input


def _greedy(engine, hidden, fi) -> list[int]:
    return engine.model.logits(hidden, fi.selected_token_idxes).argmax(-1).tolist()


def _finish_step(engine, sched, fi, tokens):
    engine.scheduler.postprocess(sched, dict(zip(fi.selected_seq_ids, tokens, strict=True)),
                                 engine.eos_token_ids)


def test_every_bucket_matches_eager(folder):
    engine = _engine(folder)
    ex: GraphExecutor = engine.worker.executor
    ptrs = {k: v.data_ptr() for k, v in ex.buffers.tensors().items()}
    graph_steps, keys_seen = 0, set()
    for n in SIZES:
        _add(engine, n, max_tokens=3, seed=n)
        while engine.has_unfinished():
            sched, fi, dev = _prepared_step(engine)
            if not fi.attn.is_decode_only:           # the prompts: eager by design
                out = engine.worker.step_internal(dev)
                _finish_step(engine, sched, fi, out.next_tokens.tolist())
                continue
            assert fi.attn.num_decodes == n
            eager = ex.eager.forward(dev).clone()
            captures = ex.graph_stats.captures
            graph = ex.forward(dev).clone()
            key = ex.plan(dev)
            assert key == GraphKey(ex.buckets.bucket(n))
            first_sight = key not in keys_seen
            keys_seen.add(key)
            assert ex.graph_stats.captures == captures + first_sight
            graph_steps += 1
            assert graph.shape == eager.shape == (n, engine.model_config.hidden_size)
            torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
            tokens = _greedy(engine, graph, fi)
            assert tokens == _greedy(engine, eager, fi), f"batch {n}"
            _finish_step(engine, sched, fi, tokens)
        for rid in list(engine.requests):
            engine.release(rid)
    assert {k.num_tokens for k in keys_seen} == {1, 2, 4, 8, 16, 32, 48, 64}
    assert ex.graph_stats.captures == len(keys_seen) == len(ex.graphs)
    assert ex.graph_stats.replays == graph_steps - len(keys_seen)
    assert {k: v.data_ptr() for k, v in ex.buffers.tensors().items()} == ptrs


def _cache_snapshot(engine):
    return [t.clone() for t in engine.kv_cache.k + engine.kv_cache.v]


def _cache_tensors(engine):
    return engine.kv_cache.k + engine.kv_cache.v


def test_padding_rows_never_change_a_real_block(folder):
    """Four sequences replay in bucket 4, then one finishes: the next step of the other
    three replays in bucket 4 with a padding row where the finished sequence's data
    still sits in the buffers. Afterwards the cache differs from before only in the three
    real rows' new slots (equal to the eager step's values) and the padding block."""
    engine = _engine(folder, block_size=4)
    ex = engine.worker.executor
    prompts = random_prompts(4, [6, 9, 13, 5], engine.vocab_size, seed=3)
    for i, p in enumerate(prompts):    # r3 stops after its first decode step
        engine.add_request(f"r{i}", p, SamplingParams(
            max_tokens=2 if i == 3 else 50, temperature=0.0, ignore_eos=True))
    while True:
        sched, fi, dev = _prepared_step(engine)
        if fi.attn.is_decode_only and fi.attn.num_decodes == 3:
            break
        _finish_step(engine, sched, fi, _greedy(engine, ex.forward(dev), fi))
    assert GraphKey(4) in ex.graphs and ex.buckets.bucket(3) == 4
    # the buffers' row 3 still holds the finished sequence's real slot
    stale_slot = int(ex.buffers.slot_mapping[3])
    assert stale_slot // engine.kv_cache.block_size != PADDING_BLOCK_ID

    before = _cache_snapshot(engine)
    ex.eager.forward(dev)
    after_eager = _cache_snapshot(engine)
    for t, b in zip(_cache_tensors(engine), before, strict=True):
        t.copy_(b)
    replays = ex.graph_stats.replays
    ex.forward(dev)
    assert ex.graph_stats.replays == replays + 1
    after_graph = _cache_snapshot(engine)

    bs = engine.kv_cache.block_size
    real_slots = dev.attn.slot_mapping.tolist()
    for b, e, g in zip(before, after_eager, after_graph, strict=True):
        # [Hk, blocks, bs, D] -> one row per slot [blocks*bs, Hk, D]
        flat_b, flat_e, flat_g = (x.permute(1, 2, 0, 3).reshape(-1, x.shape[0], x.shape[3])
                                  for x in (b, e, g))
        changed = (flat_g != flat_b).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= set(real_slots) | set(range(bs)), "a real block changed"
        torch.testing.assert_close(flat_g[bs:], flat_e[bs:], rtol=1e-5, atol=1e-5)
        assert torch.equal(flat_g[stale_slot], flat_b[stale_slot])


def test_bind_resets_padding_rows(folder):
    engine = _engine(folder, block_size=4)
    buf = engine.worker.executor.buffers
    _add(engine, 5, max_tokens=3, lengths=[9, 2, 17, 5, 11])
    sched, fi, dev = _prepared_step(engine)
    _finish_step(engine, sched, fi, engine.worker.step_internal(dev).next_tokens.tolist())
    sched, fi, dev = _prepared_step(engine)
    assert fi.attn.is_decode_only
    buf.bind(dev, GraphKey(8))
    a = fi.attn
    w = a.block_tables.shape[1]
    assert torch.equal(buf.token_ids[:5], fi.token_ids)
    assert torch.equal(buf.block_tables[:5, :w], a.block_tables)
    assert (buf.block_tables[:5, w:] == PADDING_BLOCK_ID).all()
    assert (buf.block_tables[5:8] == PADDING_BLOCK_ID).all()
    assert buf.slot_mapping[5:8].tolist() == [0, 0, 0]
    assert buf.seq_lens[5:8].tolist() == [1, 1, 1]
    assert buf.paged_kv_last_page_len[5:8].tolist() == [1, 1, 1]
    m = a.paged_kv_indices.numel()
    assert buf.paged_kv_indptr[:6].tolist() == a.paged_kv_indptr.tolist()
    assert buf.paged_kv_indptr[6:9].tolist() == [m + 1, m + 2, m + 3]
    assert buf.paged_kv_indices[:m].tolist() == a.paged_kv_indices.tolist()
    assert buf.paged_kv_indices[m:m + 3].tolist() == [0, 0, 0]
    assert buf.query_start_loc[:9].tolist() == list(range(9))


def test_decode_forward_has_no_data_dependent_ops():
    """On the meta device, tensors have shapes but no data: .item(), .tolist(),
    nonzero(), masked_select() and any shape computed from values raise. The graph's
    forward over the persistent buffers must run there."""
    from engine.models.decoder import DecoderForCausalLM
    from engine.models.model_config import ModelConfig

    cfg = ModelConfig.from_dict(_META_CFG)
    meta = torch.device("meta")
    with meta:
        model = DecoderForCausalLM(cfg)
    kv = KVCache(cfg.num_hidden_layers, 40, 16, cfg.num_key_value_heads, cfg.head_dim,
                 torch.float32, meta)
    buf = GraphBuffers(16, 1, 8, 16, cfg.hidden_size, torch.float32, meta)
    key = GraphKey(16)
    with torch.inference_mode():
        hidden = model(buf.token_ids[:16], buf.positions[:16], kv, buf.metadata(key))
    assert hidden.shape == (16, cfg.hidden_size) and hidden.device.type == "meta"
    # and the check can fail: the prefill path reads host data, the meta device refuses
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.zeros(3, device=meta).nonzero()


_META_CFG = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
}


def test_verify_rows_wider_than_the_buffers_go_eager(folder):
    """A speculative-verify batch (k+1 tokens per sequence) needs buffers sized for it
    (max_tokens_per_seq); until then it runs eagerly under its own reason."""
    from dataclasses import replace

    engine = _engine(folder)
    ex = engine.worker.executor
    _add(engine, 3, max_tokens=3)
    sched, fi, dev = _prepared_step(engine)
    _finish_step(engine, sched, fi, engine.worker.step_internal(dev).next_tokens.tolist())
    sched, fi, dev = _prepared_step(engine)
    assert ex.plan(dev) == GraphKey(4, 1)
    wide = replace(dev, attn=replace(dev.attn, num_decode_tokens=3 * 3))
    assert ex.plan(wide) == "verify_too_wide"


def test_attention_plan_prepared_once_per_forward_and_replay(folder, monkeypatch):
    """The model prepares the attention plan once per forward, before its layers (two
    here); a graph forward prepares it inside the captured callable, so every replay
    rebuilds it from the bound buffers. The torch decode path (switched on at engine
    construction) puts the masks in the plan: each must match the live lengths."""
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION_KERNEL", "0")
    engine = _engine(folder)
    ex: GraphExecutor = engine.worker.executor
    backend = engine.model.attention
    plans, real = [], backend.prepare
    monkeypatch.setattr(backend, "prepare", lambda *a: plans.append(real(*a)) or plans[-1])
    _add(engine, 5, max_tokens=5, seed=3)
    graph_steps = 0
    while engine.has_unfinished():
        sched, fi, dev = _prepared_step(engine)
        before = len(plans)
        if not fi.attn.is_decode_only:
            out = engine.worker.step_internal(dev)
            assert len(plans) == before + 1
            _finish_step(engine, sched, fi, out.next_tokens.tolist())
            continue
        eager = ex.eager.forward(dev).clone()
        graph = ex.forward(dev).clone()
        assert len(plans) == before + 2         # one each: eager, capture or replay
        masked = plans[-1].groups[0].masked
        for i, n in enumerate(fi.attn.seq_lens_host[:fi.attn.num_decodes]):
            assert masked[i].tolist() == [p >= n for p in range(masked.shape[1])]
        torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
        tokens = _greedy(engine, graph, fi)
        assert tokens == _greedy(engine, eager, fi)
        _finish_step(engine, sched, fi, tokens)
        graph_steps += 1
    assert graph_steps >= 3 and ex.graph_stats.replays >= 2
