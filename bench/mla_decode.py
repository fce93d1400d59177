"""MLA's absorbed decode on CPU: the C++ latent kernel against the torch einsums
(engine/models/mla.py, engine/csrc/cpu/latent_attention.cpp), the two paths the engine
chooses between at load (engine/models/mla_choice.py).

    .venv/bin/python bench/mla_decode.py [--dtype bfloat16] [--heads 16] [--reps 10]

DeepSeek-V3's latent width (kv_lora_rank 512 + rope 64), block size 16, random cache and
queries, one layer's attention: uniform batches (8 x 1,024, 32 x 256 tokens), one long
sequence with 128 heads, and a ragged batch (64 to 4,096 tokens), where the torch path pads
every sequence to the widest. Prints the CPU and kernel / torch time per shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_line, cpu_record  # noqa: E402
from engine.layers import cpu_latent_attention  # noqa: E402
from engine.layers.kernel_select import best_of  # noqa: E402
from engine.models.mla_choice import ragged_tables  # noqa: E402

R, P, BS = 512, 64, 16


def case(lens: list[int], heads: int, dtype: torch.dtype, reps: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    tables, nxt = ragged_tables(lens, BS)
    cache = torch.randn(1, nxt, BS, R + P, generator=gen).to(dtype)
    ql = torch.randn(len(lens), heads, R, generator=gen).to(dtype)
    qp = torch.randn(len(lens), heads, P, generator=gen).to(dtype)
    kv = torch.tensor(lens, dtype=torch.int32)
    meta = SimpleNamespace(block_tables=tables, seq_lens=kv)

    def kernel():
        return cpu_latent_attention.latent_decode_attention(ql, qp, cache, tables, kv, 1, 0.1)

    def einsums():       # mla.py's torch path, from q_lat on
        lat = cache[0][meta.block_tables.long()].view(len(lens), -1, R + P)
        s = (torch.einsum("bhr,blr->bhl", ql, lat[..., :R])
             + torch.einsum("bhp,blp->bhl", qp, lat[..., R:])) * 0.1
        allowed = torch.arange(lat.shape[1])[None, :] < kv[:, None]
        p = torch.softmax(s.masked_fill(~allowed[:, None], float("-inf")).float(), -1)
        return torch.einsum("bhl,blr->bhr", p.to(dtype), lat[..., :R])
    # the same attention; in bf16 both round the scores (random ones, std ~2.4) to 8 bits
    a, b = kernel().float(), einsums().float()
    assert (a - b).norm() <= (5e-2 if dtype == torch.bfloat16 else 1e-4) * b.norm(), \
        "the two paths disagree"
    return best_of(kernel, reps), best_of(einsums, reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="short sequences (a smoke)")
    args = ap.parse_args()
    if cpu_latent_attention.kernel() is None:
        print("the C++ latent kernel does not build here")
        return 1
    print(cpu_line(cpu_record()))
    dtype = getattr(torch, args.dtype)
    scale = 16 if args.quick else 1
    shapes = [("8 x 1024", [1024 // scale] * 8, args.heads),
              ("32 x 256", [256 // scale] * 32, args.heads),
              ("1 x 4096, 128 heads", [4096 // scale], 128),
              ("ragged 64-4096", [n // scale for n in (64, 4096, 200, 1024, 96, 512, 2048,
                                                        128)], args.heads)]
    print(f"{'shape':24} {'kernel ms':>10} {'torch ms':>10} {'kernel/torch':>13}")
    for name, lens, heads in shapes:
        k, t = case(lens, heads, dtype, args.reps)
        print(f"{name:24} {k * 1e3:10.2f} {t * 1e3:10.2f} {k / t:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
