"""Qwen3-MoE's sparse block (engine/models/moe.py) against HF's own modules on the same
weights, bit for bit in float32: the router (float32 softmax, top-k, norm_topk_prob) and
the experts as a grouped GEMM over tokens sorted by expert, for any token count, expert
count and top-k (Hypothesis); both checkpoint forms of the expert weights; clear errors
for configs it cannot serve."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import moe
from engine.models.model_config import ModelConfig


def _cfg(**over) -> ModelConfig:
    raw = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=16,
               intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
               num_key_value_heads=1, head_dim=8, num_experts=6, num_experts_per_tok=2,
               moe_intermediate_size=8, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[], hidden_act="silu")
    raw.update(over)
    return ModelConfig.from_dict(raw)


def _hf_pair(cfg: ModelConfig, seed: int):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    raw = {k: v for k, v in cfg.raw.items() if k != "architectures"}
    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**raw)).float()
    ours = moe.SparseMoeBlock(cfg).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
    return hf, ours


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tokens=st.integers(0, 40), experts=st.integers(1, 9), data=st.data())
def test_the_block_equals_hf_bit_for_bit(tokens, experts, data):
    top_k = data.draw(st.integers(1, experts))
    norm = data.draw(st.booleans())
    cfg = _cfg(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
    hf, ours = _hf_pair(cfg, seed=tokens * 31 + experts)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        want = hf(x[None])[0]
        got = ours(x)
        _, hf_weights, hf_ids = hf.gate(x)
        ids, weights = ours.route(x)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    assert torch.equal(got, want)


def test_which_layers_are_sparse():
    cfg = _cfg(decoder_sparse_step=2, mlp_only_layers=[3])
    assert [moe.is_sparse_layer(cfg, i) for i in range(4)] == [False, True, False, False]
    dense = ModelConfig.from_dict({**cfg.raw, "architectures": ["Qwen3ForCausalLM"]})
    assert not any(moe.is_sparse_layer(dense, i) for i in range(4))


def test_expert_weights_load_merged_or_one_tensor_per_expert():
    class Handle:
        def __init__(self, tensors):
            self.tensors = tensors

        def get_tensor(self, name):
            return self.tensors[name]

    gen = torch.Generator().manual_seed(0)
    e, i, h = 3, 4, 5
    per = {}
    for x in range(e):
        for part, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            per[f"model.layers.1.mlp.experts.{x}.{part}.weight"] = torch.randn(shape,
                                                                              generator=gen)
    handles = {k: Handle(per) for k in per}
    gate_up = moe.expert_tensor("model.layers.1.mlp.experts.gate_up_proj", handles, e)
    down = moe.expert_tensor("model.layers.1.mlp.experts.down_proj", handles, e)
    assert gate_up.shape == (e, 2 * i, h) and down.shape == (e, h, i)
    assert torch.equal(gate_up[2, :i], per["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(gate_up[2, i:], per["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert torch.equal(down[1], per["model.layers.1.mlp.experts.1.down_proj.weight"])
    merged = {"model.layers.1.mlp.experts.down_proj": down}
    assert torch.equal(moe.expert_tensor("model.layers.1.mlp.experts.down_proj",
                                         {k: Handle(merged) for k in merged}, e), down)
    del handles["model.layers.1.mlp.experts.2.up_proj.weight"]
    assert moe.expert_tensor("model.layers.1.mlp.experts.gate_up_proj", handles, e) is None


@pytest.mark.parametrize("over, message", [
    (dict(num_experts_per_tok=7), "num_experts_per_tok 7 exceeds num_experts 6"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size must be a positive integer"),
    (dict(num_experts=None), "num_experts must be a positive integer"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
])
def test_a_config_it_cannot_serve_is_named(over, message):
    with pytest.raises(ValueError, match=message):
        moe.check_config(_cfg(**over))


def _deepseek_pair(tokens: int, groups: int, topk_group: int, top_k: int, shared: int,
                   norm: bool, seed: int):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    experts = 4 * groups
    raw = dict(hidden_size=16, moe_intermediate_size=8, n_routed_experts=experts,
               num_experts_per_tok=top_k, n_group=groups, topk_group=topk_group,
               n_shared_experts=shared, norm_topk_prob=norm, routed_scaling_factor=2.5,
               hidden_act="silu", first_k_dense_replace=0)
    hf = DeepseekV3MoE(DeepseekV3Config(**raw)).float().eval()
    cfg = ModelConfig.from_dict({"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64,
                                 "intermediate_size": 32, "num_hidden_layers": 2,
                                 "num_attention_heads": 2, "kv_lora_rank": 8,
                                 "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                                 "v_head_dim": 4, **raw})
    ours = moe.DeepseekMoeBlock(cfg).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs = dict(hf.named_parameters()) | dict(hf.named_buffers())
        for p in theirs.values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        mine = dict(ours.named_parameters()) | dict(ours.named_buffers())
        assert set(mine) <= set(theirs)         # HF's names, so checkpoints load as they are
        for name, p in mine.items():
            p.copy_(theirs[name])
    x = torch.randn(tokens, 16, generator=gen)
    return hf, ours, x


# HF builds a zero-width shared MLP when n_shared_experts is 0 and torch warns at its init
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")
@settings(max_examples=40, deadline=None, derandomize=True)
@given(tokens=st.integers(1, 24), groups=st.integers(1, 4), data=st.data())
def test_deepseek_block_equals_hf_bit_for_bit(tokens, groups, data):
    """Sigmoid scores with the correction bias for the choice only, grouped top-k, the
    routed scaling, shared experts: HF's DeepseekV3MoE on the same weights."""
    topk_group = data.draw(st.integers(1, groups))
    top_k = data.draw(st.integers(1, 4 * topk_group))
    shared = data.draw(st.integers(0, 2))   # 0: HF's shared MLP has width 0 and adds zeros
    norm = data.draw(st.booleans())
    hf, ours, x = _deepseek_pair(tokens, groups, topk_group, top_k, shared, norm,
                                 seed=tokens * 7 + groups)
    with torch.inference_mode():
        _, hf_weights, hf_ids = hf.gate(x)
        ids, weights = ours.route(x)
        want, got = hf(x[None])[0], ours(x)
    order, hf_order = ids.sort(dim=-1), hf_ids.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    assert torch.equal(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices))
    assert torch.equal(got, want)
