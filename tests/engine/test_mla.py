"""DeepSeek-V3's MLA (engine/models/mla.py): the latent cache's layout, the absorbed decode
against the expanded form, and clear errors for configs it cannot serve. Token-exactness
against HF (prefix cache on and off, chunked prefill, preemption, graphs) runs in the
shared grids of test_hf_exactness.py and test_graph_engine.py ("deepseek-v3-mla"), PD in
tests/prefill_node/test_pd_push.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.models.mla_layout import kv_cache_layout, mla_dims, softmax_scale
from engine.models.model_config import ModelConfig
from engine.pd_fingerprint import LATENT_KV_LAYOUT, engine_fingerprint
from tests.tiny_models import make_tiny_model

BS = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_model("deepseek-v3-mla", tmp_path_factory.mktemp("models"))[0]
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", block_size=BS,
                                  num_gpu_blocks=64, max_num_seqs=4))


def test_the_cache_keeps_one_latent_row_a_token_and_no_v(engine):
    mc = engine.model_config
    raw = mc.raw
    width = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    kv = engine.kv_cache
    assert kv.k[0].shape == (1, 64, BS, width) and kv.v[0].numel() == 0
    # what an MHA cache of the same heads would keep: K and V of every head
    mha = 2 * mc.num_attention_heads * (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"])
    assert width < mha / 4
    fp = engine_fingerprint(engine)
    assert (fp.kv_layout, fp.num_kv_heads, fp.head_dim) == (LATENT_KV_LAYOUT, 1, width)


def _meta(seq_lens: list[int], tables: torch.Tensor, decode: bool):
    """Attention metadata of single-row sequences: decode rows, or the same rows as
    one-token prefills after their context (what the expanded form computes)."""
    n = len(seq_lens)
    return SimpleNamespace(
        block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_decodes=n if decode else 0, num_prefills=0 if decode else n,
        num_padding=0, num_decode_tokens=n if decode else 0,
        query_lens_host=[1] * n, context_lens_host=[s - 1 for s in seq_lens])


def _ragged_batch(d, hq, lens, rows, dtype, seed):
    from engine.models.mla_choice import ragged_tables
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(1, 64, BS, d.latent)
    tables, nxt = ragged_tables(lens, BS)
    cache[0, 1:nxt] = torch.randn(nxt - 1, BS, d.latent, generator=g)
    q_nope = torch.randn(len(lens) * rows, hq, d.nope, generator=g).to(dtype)
    q_pe = torch.randn(len(lens) * rows, hq, d.rope, generator=g).to(dtype)
    meta = SimpleNamespace(block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32))
    return q_nope, q_pe, cache.to(dtype), meta


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=4), seed=st.integers(0, 9999))
def test_absorbed_decode_matches_the_expanded_form(engine, lens, seed):
    """The absorbed form reassociates two float32 products ((q W_UK) c instead of q (W_UK c),
    and (p c) W_UV instead of p (c W_UV)): each output is a sum of at most R x (ctx) terms
    either way, so the two differ by a few float32 ulps of the largest partial sums. With
    the tiny model's latents (|c| ~ 1, |W| ~ 0.05, R = 32, ctx <= 40) the outputs are O(1)
    and such sums are below 2^4, whose ulp is 2^-19 ~ 1.9e-6: the bound below is 8 of those
    plus a relative 1e-5 for the softmax's exp. Measured: at most 2.4e-7 (outputs up to 0.17)
    over 30 random contexts on each of the three layers."""
    attn = engine.model.layers[0].self_attn
    q_nope, q_pe, cache, meta = _ragged_batch(attn.dims, attn.num_heads, lens, 1,
                                              torch.float32, seed)
    tables = meta.block_tables
    with torch.no_grad():
        absorbed = attn._decode(q_nope, q_pe, cache, _meta(lens, tables, True), len(lens))
        expanded = torch.empty_like(absorbed)
        attn._prefill(q_nope, q_pe, cache, _meta(lens, tables, False), 0, expanded)
    torch.testing.assert_close(absorbed, expanded, atol=8 * 2 ** -19, rtol=1e-5)


@pytest.mark.parametrize("field,value", [("kv_lora_rank", None), ("qk_rope_head_dim", 0),
                                         ("v_head_dim", "16"), ("q_lora_rank", -1)])
def test_a_bad_mla_field_is_named(field, value):
    raw = {"kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
           "v_head_dim": 16, "q_lora_rank": 24, field: value}
    with pytest.raises(ValueError, match=field):
        mla_dims(raw, "DeepseekV3ForCausalLM")


def test_yarn_mscale_scales_the_softmax_and_the_layout_is_read_from_the_config():
    raw = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128, "q_lora_rank": 1536,
           "rope_scaling": {"rope_type": "yarn", "factor": 40, "mscale_all_dim": 1.0}}
    from transformers.modeling_rope_utils import yarn_apply_mscale
    d = mla_dims(raw, "DeepseekV3ForCausalLM")
    hf = yarn_apply_mscale(raw["rope_scaling"], 192 ** -0.5)      # what HF's attention uses
    assert hf > 192 ** -0.5 and softmax_scale(raw, d) == pytest.approx(hf, rel=1e-15)
    assert kv_cache_layout(raw, "DeepseekV3ForCausalLM") == (1, 576, 0)
    assert kv_cache_layout(raw, "LlamaForCausalLM") is None
    # DeepSeek-V3's own config.json has no head_dim: the rotary's width is the rope's
    cfg = ModelConfig.from_dict({"architectures": ["DeepseekV3ForCausalLM"],
                                 "vocab_size": 100, "hidden_size": 7168,
                                 "intermediate_size": 18432, "num_hidden_layers": 2,
                                 "num_attention_heads": 128, **raw})
    assert cfg.head_dim == 64 and cfg.kv_layout == (1, 576, 0)


def test_the_models_own_mtp_layer_equals_hf_modules(tmp_path_factory):
    """DeepSeek-V3's MTP layer (num_nextn_predict_layers: enorm, hnorm, eh_proj, an MLA +
    DeepSeekMoE decoder layer, shared_head.norm) as engine/models/mtp.py runs it, against
    a reference built from HF's own modules (HF drops these weights when it loads the
    model): DeepseekV3DecoderLayer at index num_hidden_layers, HF's RMSNorm and rotary,
    a bias-free linear for eh_proj; the same weights, read from the checkpoint."""
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
        DeepseekV3RotaryEmbedding,
    )

    from engine.forward_input import AttentionMetadata
    from engine.kv_cache import KVCache
    from engine.models.loader import load_model
    from engine.models.mla import MlaAttention
    from engine.models.moe import DeepseekMoeBlock
    from engine.models.mtp import load_mtp
    from tests.tiny_mtp import with_mtp

    root = tmp_path_factory.mktemp("mla-mtp")
    folder, hf = make_tiny_model("deepseek-v3-mla", root)
    folder = with_mtp(folder, root / "deepseek-v3-mla-mtp")
    model, cfg = load_model(folder, torch.float32, torch.device("cpu"))
    mtp = load_mtp(folder, model, torch.float32, torch.device("cpu"))
    assert isinstance(mtp.layer.self_attn, MlaAttention)
    assert isinstance(mtp.layer.mlp, DeepseekMoeBlock)          # layer 3 >= first dense 1

    n, h = cfg.num_hidden_layers, cfg.hidden_size
    weights = {k[len(f"model.layers.{n}."):]: v
               for k, v in load_file(folder / "mtp.safetensors").items()}
    hcfg = hf.config
    hcfg._attn_implementation = "eager"
    layer = DeepseekV3DecoderLayer(hcfg, layer_idx=n).eval()
    layer.load_state_dict({k: v for k, v in weights.items() if not k.startswith(
        ("enorm.", "hnorm.", "eh_proj.", "shared_head."))})
    enorm, hnorm, head_norm = (DeepseekV3RMSNorm(h, hcfg.rms_norm_eps) for _ in range(3))
    enorm.weight.data = weights["enorm.weight"]
    hnorm.weight.data = weights["hnorm.weight"]
    head_norm.weight.data = weights["shared_head.norm.weight"]
    eh_proj = torch.nn.Linear(2 * h, h, bias=False)
    eh_proj.weight.data = weights["eh_proj.weight"]

    g = torch.Generator().manual_seed(5)
    t = 11
    tokens = torch.randint(3, 320, (t,), generator=g)
    prev = torch.randn(t, h, generator=g)                 # the target's hidden states
    pos = torch.arange(t)
    with torch.no_grad():
        x = eh_proj(torch.cat((enorm(hf.model.embed_tokens(tokens)), hnorm(prev)), -1))
        cos_sin = DeepseekV3RotaryEmbedding(hcfg)(x[None], pos[None])
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        ref = layer(x[None], attention_mask=mask, position_ids=pos[None],
                    position_embeddings=cos_sin)[0]
        ref_logits = hf.lm_head(head_norm(ref))

        cache = KVCache(1, 8, BS, *cfg.kv_layout[:2], torch.float32, torch.device("cpu"),
                        v_head_dim=cfg.kv_layout[2])
        nb = -(-t // BS)
        i32 = dict(dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=pos + BS, seq_lens=torch.tensor([t], **i32),
            query_start_loc=torch.tensor([0, t], **i32),
            block_tables=torch.arange(1, nb + 1, **i32)[None],
            paged_kv_indptr=torch.tensor([0, nb], **i32),
            paged_kv_indices=torch.arange(1, nb + 1, **i32),
            paged_kv_last_page_len=torch.tensor([t - (nb - 1) * BS], **i32),
            num_prefills=1, query_lens_host=[t], context_lens_host=[0], seq_lens_host=[t])
        ours = mtp(tokens, prev, pos, cache.k[0], cache.v[0], meta)
        logits = mtp.logits(ours)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


def test_absorbed_and_expanded_decode_agree_on_logits_and_tokens(tmp_path_factory,
                                                                  monkeypatch):
    """The whole model, decode rows absorbed (the default) against expanded
    (PDSERVE_MLA_ABSORBED_DECODE=0), eager and graphs: the same greedy tokens, and every
    step's top-5 logprobs within 2e-5. Why that bound: the attention outputs differ by at
    most 8 ulps of 2^-19 (test above), and three layers of O(1) weights carry that to the
    logits without growing it by more than the hidden size's few-fold sums; measured here
    the largest logprob difference is 1.4e-6."""
    from engine import LLM, SamplingParams
    from engine.layers.kernel_options import MLA_ABSORBED_DECODE_ENV
    from tests.tiny_models import random_prompts

    folder = make_tiny_model("deepseek-v3-mla", tmp_path_factory.mktemp("models"))[0]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, [3, 9, 17, 30], 320, 7)]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5)
    runs = {}
    for form in ("1", "0"):
        monkeypatch.setenv(MLA_ABSORBED_DECODE_ENV, form)
        for graph in (False, True):
            llm = LLM(str(folder), dtype="float32", block_size=BS, enable_graph=graph)
            assert llm.engine.model.layers[0].self_attn.absorbed is (form == "1")
            runs[form, graph] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for graph in (False, True):
        for a, e in zip(runs["1", graph], runs["0", graph], strict=True):
            assert a.token_ids == e.token_ids
            for la, le in zip(a.logprobs, e.logprobs, strict=True):
                assert [t for t, _ in la.top] == [t for t, _ in le.top]
                assert [lp for _, lp in la.top] == pytest.approx([lp for _, lp in le.top],
                                                                 abs=2e-5)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=4), rows=st.integers(1, 3),
       bf16=st.booleans(), seed=st.integers(0, 9999))
def test_the_cpu_latent_kernel_matches_the_torch_absorbed_form(engine, lens, rows, bf16,
                                                                 seed):
    """engine/csrc/cpu/latent_attention.cpp against mla.py's torch einsums, decode rows and
    k+1-row verify runs (row j of a run sees its sequence up to L - rows + j), ragged
    lengths. The same products, summed by different GEMMs (the kernel scores q . [c | k_pe]
    in one product, the einsums in two added): float32 within the absorbed-vs-expanded
    bound above; bf16 within one bf16 rounding of the scores and of the output (2^-8
    relative each)."""
    from engine.layers import cpu_latent_attention
    attn = engine.model.layers[0].self_attn
    assert cpu_latent_attention.kernel() is not None
    dtype = torch.bfloat16 if bf16 else torch.float32
    lens = [max(n, rows) for n in lens]
    q_nope, q_pe, cache, meta = _ragged_batch(attn.dims, attn.num_heads, lens, rows, dtype,
                                              seed)
    outs, saved = [], attn.use_cpu_kernel
    weight = attn.kv_b_proj.weight.data          # the only weight the decode reads
    try:
        attn.kv_b_proj.weight.data = weight.to(dtype)
        for kernel in (True, False):
            attn.use_cpu_kernel = kernel
            with torch.no_grad():
                outs.append(attn._decode(q_nope, q_pe, cache, meta, len(lens)).float())
    finally:
        attn.use_cpu_kernel = saved
        attn.kv_b_proj.weight.data = weight
    tol = dict(atol=8 * 2 ** -19, rtol=1e-5) if not bf16 else dict(atol=2e-2, rtol=2 ** -7)
    torch.testing.assert_close(outs[0], outs[1], **tol)


@pytest.mark.parametrize("fastest", ["kernel", "torch"])
def test_the_decode_path_is_chosen_by_measurement_and_kept(engine, tmp_path, monkeypatch,
                                                           fastest):
    """Injected timings pick the path; a second engine reads the kept choice, timing
    nothing."""
    from engine.layers import kernel_choice, kernel_select
    from engine.models import mla_choice

    monkeypatch.setattr(kernel_choice, "CHOICES",
                        kernel_choice.ChoiceCache(tmp_path / "choices.json"))
    attn = engine.model.layers[0].self_attn
    seen: list[str] = []

    def timer(call):
        call()
        seen.append("kernel" if attn.use_cpu_kernel else "torch")
        return {"kernel": 2.0, "torch": 2.0, fastest: 1.0}[seen[-1]]
    monkeypatch.setattr(kernel_select, "best_of", timer)
    saved = [m.self_attn.use_cpu_kernel for m in engine.model.layers]
    try:
        for m in engine.model.layers:
            m.self_attn.use_cpu_kernel = True
        assert mla_choice.choose_decode(engine.model, BS, torch.float32,
                                        torch.device("cpu")) == fastest
        assert sorted(seen) == ["kernel", "torch"]
        assert all(m.self_attn.use_cpu_kernel is (fastest == "kernel")
                   for m in engine.model.layers)
        seen.clear()
        for m in engine.model.layers:
            m.self_attn.use_cpu_kernel = True
        assert mla_choice.choose_decode(engine.model, BS, torch.float32,
                                        torch.device("cpu")) == fastest
        assert seen == []
    finally:
        for m, s in zip(engine.model.layers, saved, strict=True):
            m.self_attn.use_cpu_kernel = s
