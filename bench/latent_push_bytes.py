"""Bytes a PD push ships per prompt token: MLA's latent cache against an MHA model of the same
size (engine/models/mla.py).

    .venv/bin/python bench/latent_push_bytes.py [--dtype bfloat16] [--tokens 256]

Builds two random models with transformers' `from_config`: a DeepSeek-V3 (MLA) and its MHA
twin (a Llama of the same hidden size, layers and heads, K and V heads as wide as MLA's
query-key head, nope + rope), prefills the same
prompt on each through the prefill node's push connector (engine/pd_prefill.py) and counts
what it hands the push: every layer's K and V for the prompt's blocks, the bytes the push
sends. Then the same arithmetic for DeepSeek-V3's published sizes (61 layers, 128 heads,
kv_lora_rank 512, rope 64, nope 128, v 128; its MHA twin: K 192 and V 128 a head), which
this machine cannot load.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_line, cpu_record  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine_core import LLMEngine  # noqa: E402
from engine.pd_prefill import KvPushConnector, push_request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

SIZES = dict(hidden_size=256, num_attention_heads=8, num_hidden_layers=2, vocab_size=512,
             intermediate_size=512, max_position_embeddings=4096)
MLA = dict(q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
           v_head_dim=32, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
           n_group=1, topk_group=1, moe_intermediate_size=64)


class CountingSink:
    def __init__(self):
        self.bytes = 0

    def on_layer(self, layer, dst_block_ids, k, v, ready):
        self.bytes += (k.numel() + v.numel()) * k.element_size()

    def on_step_end(self):
        pass

    def on_first_token(self, *args, **kwargs):
        pass

    def on_error(self, exc):
        raise exc


def pushed_bytes(folder: Path, dtype: str, tokens: int) -> int:
    cfg = EngineConfig(model=str(folder), dtype=dtype, block_size=16, num_gpu_blocks=64,
                       max_num_batched_tokens=max(tokens, 16))
    eng = LLMEngine(cfg, connector=KvPushConnector)
    sink = CountingSink()
    prompt = torch.randint(3, SIZES["vocab_size"], (tokens,)).tolist()
    blocks = list(range(1, 1 + -(-tokens // 16)))
    eng.submit(push_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0),
                            blocks, 0, sink, 16))
    while eng.has_work():
        eng.run_once()
    return sink.bytes


def build(root: Path) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig
    made = []
    for name, cfg in (("mla", DeepseekV3Config(**SIZES, **MLA)),
                      ("mha", LlamaConfig(**SIZES, head_dim=MLA["qk_nope_head_dim"]
                                          + MLA["qk_rope_head_dim"]))):
        AutoModelForCausalLM.from_config(cfg).save_pretrained(root / name)
        made.append(root / name)
    return made[0], made[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    print(cpu_line(cpu_record()))
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    with tempfile.TemporaryDirectory() as tmp:
        mla, mha = build(Path(tmp))
        got = {name: pushed_bytes(folder, args.dtype, args.tokens)
               for name, folder in (("mla", mla), ("mha", mha))}
    # whole blocks are pushed: per token of the blocks the prompt fills
    tokens = -(-args.tokens // 16) * 16
    per = {k: v / tokens for k, v in got.items()}
    layers = SIZES["num_hidden_layers"]
    print(f"measured, {args.tokens}-token prompt, {args.dtype}, {layers} layers, "
          f"{SIZES['num_attention_heads']} heads:")
    print(f"  MLA latent push  {per['mla']:9.0f} bytes/token "
          f"({MLA['kv_lora_rank']} + {MLA['qk_rope_head_dim']} values a layer)")
    print(f"  MHA twin push    {per['mha']:9.0f} bytes/token")
    print(f"  MHA / MLA        {per['mha'] / per['mla']:9.1f}x")
    h, lat = 128, 512 + 64
    v3_mla, v3_mha = 61 * lat * elem, 61 * h * (128 + 64 + 128) * elem
    print(f"DeepSeek-V3's sizes (61 layers, 128 heads; arithmetic): MLA {v3_mla / 1024:.1f} "
          f"KiB/token, MHA {v3_mha / 1024:.0f} KiB/token, {v3_mha / v3_mla:.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
