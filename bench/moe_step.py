"""An MoE block's step against its matmul limit (engine/models/moe.py).

    .venv/bin/python bench/moe_step.py [--dtype bfloat16] [--experts 64] [--top-k 8]
        [--hidden 1024] [--inter 256] [--rows 1,8,32,128,512]

Times one sparse block (router, the grouped GEMM over tokens sorted by expert, the
weighted sums) on random weights and inputs at each row count, and beside it the same
expert GEMMs alone: for each expert the routing picked, gate_up and down on as many rows
as it got, with the rows already gathered (what a perfect grouped GEMM would cost on this
CPU's matmul). The ratio block / GEMMs is the block's overhead over that limit: routing,
sorting, gathering, the silu product and index_add. The default shapes are Qwen3-30B-A3B's
scaled down (it has 128 experts, top-8, hidden 2048, expert width 768). Prints the CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_line, cpu_record  # noqa: E402
from engine.layers.kernel_select import best_of  # noqa: E402
from engine.models import moe  # noqa: E402
from engine.models.model_config import ModelConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--rows", default="1,8,32,128,512")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg = ModelConfig.from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden, "num_hidden_layers": 1,
        "num_attention_heads": 8, "num_experts": args.experts,
        "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.inter,
        "norm_topk_prob": True})
    torch.manual_seed(0)
    block = moe.SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    block = block.to(dtype)
    print(f"CPU: {cpu_line(cpu_record())}")
    print(f"MoE block {args.dtype}: {args.experts} experts, top-{args.top_k}, hidden "
          f"{args.hidden}, expert width {args.inter}, torch threads {torch.get_num_threads()}")
    print(f"{'rows':>6} {'block ms':>9} {'GEMMs ms':>9} {'block/GEMMs':>12} {'experts hit':>12}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.hidden).to(dtype)
            ids, _ = block.route(x)
            counts = torch.bincount(ids.reshape(-1), minlength=args.experts).tolist()
            groups = [(e, torch.randn(n, args.hidden).to(dtype)) for e, n in enumerate(counts)
                      if n]
            def gemms(groups=groups, w_up=block.experts.gate_up_proj,
                      w_down=block.experts.down_proj):
                for e, xe in groups:
                    gate, up = F.linear(xe, w_up[e]).chunk(2, dim=-1)
                    F.linear(gate * up, w_down[e])

            t_block = best_of(lambda x=x: block(x), passes=7)
            t_gemm = best_of(gemms, passes=7)
            print(f"{rows:>6} {t_block * 1e3:>9.2f} {t_gemm * 1e3:>9.2f} "
                  f"{t_block / t_gemm:>11.2f}x {len(groups):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
