"""Causal prefill attention over the paged KV cache for CPU in bfloat16 (head_dim 64, 1-4
query heads per KV head), two kernels with one interface:

- the tile kernel (`prefill_attention`, blocks a multiple of 16 keys), on AVX512-BF16
  dot products, described below;
- the brgemm kernel (`prefill_attention_brgemm`, engine/csrc/cpu/prefill_attention_brgemm.cpp):
  the same rows as GEMMs on oneDNN's bf16 micro-kernel, which takes the AMX tiles where the
  CPU has them: a tile of 64 rows of one sequence times its G query heads against blocks of
  256 keys, the softmax online in float32 between the two GEMMs. On an AMX Xeon 1.2-1.6x
  faster than torch's flash SDPA on SmolLM2's heads when written (7 prompts of 290 tokens
  2.55 against 3.28 ms, 4 of 512 2.62 against 3.79 ms), which itself beats the tile kernel
  there; 1.84x faster again since (aligned scratch, longer blocks, a base-2 exp).

Which one runs is chosen by measurement (engine/layers/attention_choice.py).

The tile kernel:

Why: prefill rows went through the decode kernel one row at a time
(engine/layers/cpu_paged_attention.py): each row re-read its whole prefix and spent four
float32 FMAs a key and head on P.V. In the bench's mixed workload (prompts of 32-512
tokens) that was 1.8 s of a 26 s run. Here a task is one sequence, one KV head and a tile
of 8 consecutive rows, whose 8 x G query vectors share every K and V load:

- scores: a 16-key chunk of K is transposed once into bf16 pairs, then each query vector
  gets its 16 scores from 32 VDPBF16PS (no horizontal sums), four query vectors a K load;
- softmax in float32 per row over its own causal length (the decode kernel's exp, 16
  lanes at a time),
  the unnormalised probabilities rounded to bf16 once; past the row's length they are 0;
- P.V: V chunks interleaved into key pairs, 2 VDPBF16PS a key and query vector where the
  decode kernel spends 4 FMAs; the sum divides the float32 result at the end, which is
  rounded to bf16 once.

A row's result depends on its own query, keys and length only (not on its tile, chunk or
batch), so chunked prefill and prefix-cache hits give the same bits. It is not the decode
kernel's bits (bf16 probabilities; the decode kernel keeps them float32), so batch-
invariant mode, which needs a token's attention equal as a prefill and as a decode row,
keeps the row-at-a-time path. Tasks are split over torch's threads by cost (rows x keys).
"""

from __future__ import annotations

import torch

from engine.layers.cpu_extension import KernelFamily

EXTENSION = KernelFamily("CPU prefill attention")   # engine/csrc/cpu/prefill_attention.cpp


def usable(dtype: torch.dtype, head_dim: int, groups: int, block_size: int) -> bool:
    """Whether prefill rows of this shape can take the tile kernel here."""
    if dtype != torch.bfloat16 or head_dim != 64 or not 1 <= groups <= 4 or block_size % 16:
        return False
    mod = EXTENSION.load()
    return mod is not None and mod.prefill_attention_available()


def brgemm_usable(dtype: torch.dtype, head_dim: int, groups: int) -> bool:
    """Whether prefill rows of this shape can take the brgemm kernel here (its micro-kernel
    passed a self-test against a plain product when the extension loaded)."""
    if dtype != torch.bfloat16 or head_dim != 64 or not 1 <= groups <= 4:
        return False
    mod = EXTENSION.load()
    return mod is not None and mod.prefill_attention_brgemm_available()


def prefill_attention_brgemm(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, query_start: torch.Tensor,
                             context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`prefill_attention` on the brgemm kernel: the same rows, other bits."""
    return EXTENSION.load().prefill_attention_brgemm(q, k_cache, v_cache, block_tables,
                                                     query_start, context_lens, scale)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start: torch.Tensor,
                      context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of every prefill row in q (sequence s's rows at query_start[s]..
    query_start[s+1], after context_lens[s] cached keys) -> [T, Hq, 64]."""
    return EXTENSION.load().prefill_attention(q, k_cache, v_cache, block_tables, query_start,
                                              context_lens, scale)
