"""MLA's sizes and cache layout read from an HF config (engine/models/mla.py computes the
attention): kept apart from the modules so the config reader can size the KV cache without
importing them."""

from __future__ import annotations

import math
from dataclasses import dataclass

MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


@dataclass(frozen=True)
class MlaDims:
    q_lora_rank: int | None        # None: one q_proj, no low-rank query
    kv_lora_rank: int
    nope: int                      # qk_nope_head_dim
    rope: int                      # qk_rope_head_dim
    v: int                         # v_head_dim

    @property
    def latent(self) -> int:
        """Values one token leaves in a layer's latent cache."""
        return self.kv_lora_rank + self.rope


def is_mla(architecture: str) -> bool:
    return architecture in MLA_ARCHITECTURES


def mla_dims(raw: dict, architecture: str) -> MlaDims:
    """The MLA sizes of an HF config; a clear error naming a missing or bad field."""
    def need(field: str) -> int:
        value = raw.get(field)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{architecture}: config field {field} must be a positive "
                             f"integer, got {value!r}")
        return value
    q_rank = raw.get("q_lora_rank")
    if q_rank is not None and (not isinstance(q_rank, int) or q_rank < 1):
        raise ValueError(f"{architecture}: config field q_lora_rank must be a positive "
                         f"integer or null, got {q_rank!r}")
    if raw.get("rope_interleave", True) not in (True, False):
        raise ValueError(f"{architecture}: rope_interleave must be true or false")
    return MlaDims(q_rank, need("kv_lora_rank"), need("qk_nope_head_dim"),
                   need("qk_rope_head_dim"), need("v_head_dim"))


def kv_cache_layout(raw: dict, architecture: str) -> tuple[int, int, int] | None:
    """(heads, K width, V width) of an MLA model's cache: one latent row as K, no V."""
    if not is_mla(architecture):
        return None
    return 1, mla_dims(raw, architecture).latent, 0


def softmax_scale(raw: dict, dims: MlaDims) -> float:
    """(nope + rope)^-0.5, times mscale^2 under YaRN with `mscale_all_dim` (DeepSeek's
    reference scales q.k's non-rotary part too; HF's yarn_apply_mscale)."""
    scale = (dims.nope + dims.rope) ** -0.5
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        all_dim = rope.get("mscale_all_dim", 0)
        factor = rope.get("factor") or 1.0
        if all_dim and factor > 1:
            m = 0.1 * all_dim * math.log(factor) + 1.0
            scale = scale * m * m
    return scale
