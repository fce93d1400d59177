"""Attention backends behind a registry (lazy imports), so faster kernels plug in by name.

A backend writes the step's new K/V into the paged cache at `slot_mapping`, then attends
each query over its sequence's cached K/V. Decode rows come first in the batch, prefill
rows after (see engine/forward_input.py). The model calls `prepare` once per forward,
before its layers, and every layer passes the result to the backend's call.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

from engine.forward_input import AttentionMetadata
from engine.layers.kernel_options import DEFAULT_KERNELS, KernelOptions

_BACKENDS = {
    "sdpa": "engine.layers.sdpa_attention:SdpaAttention",
}


class AttentionBackend(Protocol):
    def prepare(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> Any:
        """This forward's plan, shared by every layer (caches like `k_cache`)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Any) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], caches [Hkv, blocks, block_size, D] -> [T, Hq, D];
        `plan` from `prepare` (or the bare metadata, prepared for this call alone)"""


def get_attention_backend(name: str, scale: float,
                          kernels: KernelOptions = DEFAULT_KERNELS) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: "
                         f"{', '.join(sorted(_BACKENDS))}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(scale, kernels)
