"""The paged decode kernel's path on CPU, chosen by measurement on the machine that runs.

The kernel (engine/layers/cpu_paged_attention.py) has two paths for bf16 caches of head_dim
64: "vector" scores each key against its query heads with AVX512-BF16 dot products and a
horizontal sum (~14 instructions a key for 3 query heads a KV head), and "amx" scores 16
keys against all of them with two tile products on AMX. The V pass is float32 FMAs in
both, so their outputs differ only by the scores' rounding order. On the Xeon with AMX the
tiles took 30 layers of SmolLM2's decode attention (64 rows of 32-712 keys, from memory)
from 32.8 to 27.8 ms; where a CPU's tiles are slower, or its memory so slow that scoring
is free, the vector path may win, so when the KV cache is made (its block size known) the
engine times both on a decode batch of the model's attention shape and keeps the faster
for the machine (engine/layers/kernel_choice.py: every process and node takes the same
path, as their bits differ).

- the batch: 32 decode rows of 128-512 keys (8 MB of KV for SmolLM2's 3 KV heads), four
  such layers in turn, so a pass reads more than a core's L2 holds, as decode steps do;
- float32 is not measured (the "amx" path is bf16 only), nor shapes it does not fit.

PDSERVE_CPU_DECODE_ATTENTION=vector|amx forces a path (engine/layers/kernel_options); a
forced "amx" where it cannot run is refused with a warning and the vector path runs.
"""

from __future__ import annotations

import logging

import torch

from engine.layers import cpu_paged_attention, kernel_choice, kernel_select
from engine.layers.sdpa_attention import SdpaAttention

log = logging.getLogger(__name__)

TIMED_ROWS = 32
TIMED_LENGTHS = (128, 512)      # the rows' KV lengths, spread evenly between these
TIMED_LAYERS = 4


def paths_for(backend, head_dim: int, groups: int, block_size: int,
              dtype: torch.dtype, device: torch.device) -> list[str]:
    """The paths that run here for caches of this shape, "vector" first (it runs wherever
    the kernel does)."""
    if (not isinstance(backend, SdpaAttention) or not backend.use_cpu_kernel
            or device.type != "cpu"):
        return []
    paths = ["vector"]
    if cpu_paged_attention.amx_fits(dtype, head_dim, groups, block_size):
        paths.append("amx")
    return paths


def choose(backend, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
           dtype: torch.dtype, device: torch.device) -> str | None:
    """Set `backend`'s decode path (forced, or by measurement); the path, or None where
    there is no choice (not the paged kernel, one path only and none forced)."""
    paths = paths_for(backend, head_dim, num_heads // num_kv_heads, block_size, dtype, device)
    forced = getattr(backend, "forced_decode_path", None)
    if forced is not None:
        if forced in paths:
            backend.decode_path = forced
            return forced
        if paths:
            log.warning("decode attention path %r was asked for but does not run for [%d q, %d "
                        "kv heads, head_dim %d, block %d, %s] here; the vector path runs",
                        forced, num_heads, num_kv_heads, head_dim, block_size, dtype)
        return None
    if len(paths) < 2:
        return None
    backend.decode_path = kernel_choice.choose_attention_path(
        "paged_decode_attention", "paged decode attention",
        (num_heads, num_kv_heads, head_dim, block_size), paths,
        lambda: _measure(backend, paths, num_heads, num_kv_heads, head_dim, block_size))
    return backend.decode_path


@torch.inference_mode()
def _measure(backend: SdpaAttention, paths: list[str], hq: int, hk: int, d: int,
             bs: int) -> str:
    gen = torch.Generator().manual_seed(0)
    lo, hi = TIMED_LENGTHS
    lens = torch.linspace(lo, hi, TIMED_ROWS).round().to(torch.int32)
    per_row = [-(-int(n) // bs) for n in lens]
    width = max(per_row)
    tables = torch.zeros(TIMED_ROWS, width, dtype=torch.int32)
    start = 1                                   # block 0 is the padding block, as in the engine
    for r, n in enumerate(per_row):
        tables[r, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    layers = [(torch.randn(hk, start, bs, d, generator=gen).bfloat16(),
               torch.randn(hk, start, bs, d, generator=gen).bfloat16())
              for _ in range(TIMED_LAYERS)]
    q = torch.randn(TIMED_ROWS, hq, d, generator=gen).bfloat16()

    def candidate(path: str) -> kernel_select.Candidate:
        def load():
            def call():
                for k_cache, v_cache in layers:
                    cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables,
                                                               lens, 1, backend.scale, path)
            call()
            return call
        return kernel_select.Candidate(path, load)

    best, _ = kernel_select.fastest(f"paged decode attention [{hq}, {hk}, {d}]",
                                    [candidate(p) for p in paths])
    return best
