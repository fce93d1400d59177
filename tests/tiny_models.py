"""Random-weight tiny HF models saved with save_pretrained, and HF greedy references.

Norm weights and biases are randomised too (HF initialises them to ones/zeros), so a
wrongly mapped norm or bias cannot go unnoticed; so are MoE routers (HF may start them at
zero, every expert tied) and experts.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch

CONFIGS = {
    # name: (architecture, overrides)
    "llama-tied-gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True)),
    "llama-untied-hd32-llama3rope": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen2-gqa4": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1,
                                 tie_word_embeddings=False)),
    "qwen3-qknorm-hd24": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=24, tie_word_embeddings=True)),
    # MoE blocks in layers 1 and 2, a dense MLP in layer 0 (mlp_only_layers)
    "qwen3-moe-e8k2": ("qwen3_moe", dict(num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_hidden_layers=3, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, decoder_sparse_step=1,
                                         mlp_only_layers=[0], tie_word_embeddings=False)),
    # MLA (latent KV cache) + DeepSeekMoE: 8 routed experts in 2 groups, 1 shared, the
    # first layer dense; YaRN rope with mscale_all_dim (the softmax scale's mscale^2)
    "deepseek-v3-mla": ("deepseek_v3", dict(
        num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
        q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
        routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
                      128, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                      "beta_slow": 1, "rope_theta": 10000.0})),
}
# not in the exactness grids (same architecture as one there): long prompts for fault tests
LONG_CONTEXT = {
    "qwen2-long": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1,
                                 tie_word_embeddings=False, max_position_embeddings=2048)),
}
# not in the exactness grids: the head shape of SmolLM2's attention (head_dim 64, 3 query
# heads a KV head), which the paged kernel's AVX512-BF16 and AMX paths are written for
KERNEL_SHAPES = {
    "llama-hd64-gqa3": ("llama", dict(hidden_size=96, num_attention_heads=3,
                                      num_key_value_heads=1, head_dim=64,
                                      tie_word_embeddings=True)),
}


def _config(arch: str, overrides: dict):
    from transformers import (
        DeepseekV3Config,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "qwen3_moe": Qwen3MoeConfig, "deepseek_v3": DeepseekV3Config}[arch]
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.05,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(overrides)
    return cls(**base)


def make_tiny_model(name: str, root: Path, seed: int = 0):
    """Create (or reuse) the model folder; returns (folder, hf_model in float32)."""
    from transformers import AutoModelForCausalLM
    arch, overrides = {**CONFIGS, **LONG_CONTEXT, **KERNEL_SHAPES}[name]
    folder = root / name
    if (folder / "config.json").is_file():
        return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    cfg = _config(arch, overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):     # an MoE router: decisive picks
                p.copy_(0.5 * torch.randn_like(p))
            elif ".experts." in pname:                  # HF may leave them uninitialised
                p.copy_(0.05 * torch.randn_like(p))
        for bname, b in model.named_buffers():          # DeepSeekMoE's router bias
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(folder)
    return folder, model


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])]
            for i in range(n)]


@functools.lru_cache(maxsize=4096)
def _hf_greedy_cached(model_id: int, prompt: tuple[int, ...], max_new: int):
    model = _MODELS[model_id]
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, pad_token_id=0, eos_token_id=2,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(lg[0].float(), -1)[t].item()
                for lg, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


_MODELS: dict[int, object] = {}


def hf_greedy(model, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """HF transformers' `generate`, greedy, stopping at eos (id 2) like the engine."""
    _MODELS[id(model)] = model
    return _hf_greedy_cached(id(model), tuple(prompt), max_new)
