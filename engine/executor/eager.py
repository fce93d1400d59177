"""Eager executor: run the model directly on the ForwardInput
(docs/ARCHITECTURE.md, 'The execution trunk', step 4.1)."""

from __future__ import annotations

import torch

from engine.forward_input import ForwardInput
from engine.kv_cache import KVCache


class EagerExecutor:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache

    @torch.inference_mode()
    def forward(self, fi: ForwardInput) -> torch.Tensor:
        return self.model(fi.token_ids, fi.positions, self.kv_cache, fi.attn)
