"""How much memory an engine takes, from its config and the loaded model's shapes: the KV
cache's blocks and the heap one step works in (mapped at start when the engine prefaults
its memory, engine/host_allocator.py). Pure functions: LLMEngine calls them once."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.host_allocator import step_reserve_bytes
from engine.kv_cache import KVCache
from engine.models.model_config import ModelConfig


def kv_bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """One block of the whole model's KV cache (every layer, K and V)."""
    heads, k_dim, v_dim = mc.kv_layout
    return KVCache.bytes_per_block(mc.num_hidden_layers, block_size, heads, k_dim, dtype,
                                   v_head_dim=v_dim)


def num_kv_blocks(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype,
                  max_model_len: int) -> int:
    """Blocks that fit kv_cache_memory_gb, never more than the running sequences could
    ever use, plus the padding block."""
    bs = config.block_size
    by_memory = int(config.kv_cache_memory_gb * (1 << 30)) // kv_bytes_per_block(mc, bs, dtype)
    by_need = config.max_num_seqs * -(-max_model_len // bs) + 1
    return max(2, min(by_memory, by_need))


def step_heap_bytes(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype) -> int:
    """The heap a full step's temporaries take (host_allocator.step_reserve_bytes)."""
    per_token = kv_bytes_per_block(mc, config.block_size, dtype) // config.block_size
    return step_reserve_bytes(config.max_num_batched_tokens, mc.hidden_size,
                              mc.intermediate_size, per_token, dtype.itemsize)
