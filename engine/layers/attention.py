"""Attention backends behind a registry (lazy imports), so faster kernels plug in by name.

A backend writes the step's new K/V into the paged cache at `slot_mapping`, then attends
each query over its sequence's cached K/V. Decode rows come first in the batch, prefill
rows after (see engine/forward_input.py).
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from engine.forward_input import AttentionMetadata

_BACKENDS = {
    "sdpa": "engine.layers.sdpa_attention:SdpaAttention",
}


class AttentionBackend(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], caches [blocks, block_size, Hkv, D] -> [T, Hq, D]"""


def get_attention_backend(name: str, scale: float) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: "
                         f"{', '.join(sorted(_BACKENDS))}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(scale)
