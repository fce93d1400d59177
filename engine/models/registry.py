"""Architecture name (config.json `architectures[0]`) -> model class, imported lazily.

A class is built as `cls(cfg, attention_backend=name, kernels=KernelOptions)`
(engine/models/loader.py): the kernel choice comes in as a value, never from globals.
"""

from __future__ import annotations

import importlib

from engine.models.model_config import ModelConfig

_MODELS = {
    "LlamaForCausalLM": "engine.models.decoder:DecoderForCausalLM",
    "Qwen2ForCausalLM": "engine.models.decoder:DecoderForCausalLM",
    "Qwen3ForCausalLM": "engine.models.decoder:DecoderForCausalLM",
    # Qwen3's decoder with MoE blocks (engine/models/moe.py)
    "Qwen3MoeForCausalLM": "engine.models.decoder:DecoderForCausalLM",
    # MLA attention (engine/models/mla.py) and DeepSeekMoE blocks (engine/models/moe.py)
    "DeepseekV3ForCausalLM": "engine.models.decoder:DecoderForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(cfg: ModelConfig):
    if cfg.architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module, cls = _MODELS[cfg.architecture].split(":")
    return getattr(importlib.import_module(module), cls)
