"""engine/memory_sizing.py: the KV cache's block count and a step's heap, from the config
and the model's shapes."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.host_allocator import step_reserve_bytes
from engine.memory_sizing import kv_bytes_per_block, num_kv_blocks, step_heap_bytes
from engine.models.model_config import ModelConfig
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _ = make_tiny_model("llama-tied-gqa", tmp_path_factory.mktemp("sizing"))
    return str(folder), ModelConfig.from_folder(str(folder))


def test_a_block_holds_every_layers_k_and_v(tiny):
    _, mc = tiny
    heads, k_dim, v_dim = mc.kv_layout
    want = mc.num_hidden_layers * 16 * heads * (k_dim + v_dim) * 2
    assert kv_bytes_per_block(mc, 16, torch.bfloat16) == want
    assert kv_bytes_per_block(mc, 16, torch.float32) == 2 * want


def test_blocks_are_capped_by_memory_and_by_need(tiny):
    folder, mc = tiny
    per_block = kv_bytes_per_block(mc, 16, torch.float32)
    small = EngineConfig(model=folder, kv_cache_memory_gb=10 * per_block / (1 << 30))
    assert num_kv_blocks(small, mc, torch.float32, 4096) == 10
    roomy = EngineConfig(model=folder, kv_cache_memory_gb=8.0, max_num_seqs=3)
    assert num_kv_blocks(roomy, mc, torch.float32, 100) == 3 * 7 + 1     # 100 tokens: 7
    tiny_mem = EngineConfig(model=folder, kv_cache_memory_gb=1e-9)
    assert num_kv_blocks(tiny_mem, mc, torch.float32, 100) == 2


def test_step_heap_grows_with_the_tokens_a_step_takes(tiny):
    folder, mc = tiny
    cfg = EngineConfig(model=folder, max_num_batched_tokens=512)
    per_token = kv_bytes_per_block(mc, cfg.block_size, torch.bfloat16) // cfg.block_size
    assert step_heap_bytes(cfg, mc, torch.bfloat16) == step_reserve_bytes(
        512, mc.hidden_size, mc.intermediate_size, per_token, 2)
    wider = EngineConfig(model=folder, max_num_batched_tokens=1024)
    assert step_heap_bytes(wider, mc, torch.bfloat16) > step_heap_bytes(cfg, mc, torch.bfloat16)
