"""The parts of an HF config.json the models need, read once into a frozen dataclass.

Accepts both transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`)
spellings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.models.mla_layout import kv_cache_layout


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool          # bias on q/k/v (Qwen2: always; Llama: config flag)
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool                 # Qwen3: RMSNorm over head_dim on q and k
    hidden_act: str
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    raw: dict
    # (heads, K width, V width) a token leaves per layer in the KV cache: the attention
    # heads' (num_kv_heads, head_dim, head_dim), or MLA's one latent row as K and no V
    kv_layout: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no architecture (field 'architectures')")
        arch = archs[0]
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default")
                                              != "default" else None)
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        is_llama = arch == "LlamaForCausalLM"
        mla = kv_cache_layout(cfg, arch)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if mla is not None:                 # the rotary's width (HF writes it as head_dim)
            head_dim = cfg["qk_rope_head_dim"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
            o_proj_bias=not is_qwen2 and bool(cfg.get("attention_bias", False)),
            mlp_bias=is_llama and bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            hidden_act=cfg.get("hidden_act", "silu"),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
            kv_layout=mla or (kv_heads, head_dim, head_dim),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model folder {folder} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))
