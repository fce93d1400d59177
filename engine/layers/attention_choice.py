"""bf16 prefill attention on CPU: the tile kernel, the brgemm kernel, the decode kernel row
by row, or SDPA, chosen by measurement on the machine that runs.

The tile kernel (engine/layers/cpu_prefill_attention.py) was written on an AVX512-BF16
EPYC, where it beat both others. On a Xeon with AMX, torch's SDPA (its flash attention
takes the AMX tiles through oneDNN's brgemm) was faster at every length measured: 0.88
against 1.00 ms for 8 prompts of 128 tokens, 2.56 against 10.40 ms for one of 1,024, 1.16
against 2.74 ms for a 256-token chunk after 768 cached (SmolLM2's 9 query and 3 KV heads,
head_dim 64, 2 threads); the brgemm kernel (oneDNN's micro-kernel called directly, one GEMM
per 64 rows x G heads and 128 keys) beat SDPA there in turn by 1.2-1.6x. So when the KV
cache is made (its block size is known then) the
engine times each path that runs here on one prefill batch of the model's attention shape
and keeps the fastest for the machine (engine/layers/kernel_choice.py: every process and
node of a cluster takes the same path, whose bf16 bits differ):

- the batch: a 384-token prompt and a 128-token chunk after 256 cached tokens, both as
  one forward's prefill rows (a fresh prompt and a chunked or prefix-cached one);
- float32 is not measured: its prefill always takes SDPA, whose rounding is HF's; nor is
  batch-invariant mode, whose prefill rows take the decode kernel for its bits.

PDSERVE_CPU_PREFILL_ATTENTION=tiles|brgemm|rows|sdpa forces a path (engine/layers/kernel_options).
"""

from __future__ import annotations

import logging

import torch

from engine.forward_input import AttentionMetadata
from engine.layers import decode_attention_choice, kernel_choice, kernel_select
from engine.layers.sdpa_attention import SdpaAttention

log = logging.getLogger(__name__)

# (new tokens, cached tokens before them) of the timed prefill rows
TIMED_ROWS = ((384, 0), (128, 256))


def choose_for(model: torch.nn.Module, block_size: int, dtype: torch.dtype,
               device: torch.device) -> dict[str, str]:
    """`choose` for every attention backend of `model`'s layers (a shared one once), and
    its decode rows' path (engine/layers/decode_attention_choice.py): {shape: path}."""
    table, seen = {}, set()
    for m in model.modules():
        backend = getattr(m, "backend", None)
        if backend is None or id(backend) in seen or not hasattr(m, "num_kv_heads"):
            continue
        seen.add(id(backend))
        path = choose(backend, m.num_heads, m.num_kv_heads, m.head_dim, block_size, dtype,
                      device)
        shape = f"[{m.num_heads}, {m.num_kv_heads}, {m.head_dim}] block {block_size}"
        if path is not None:
            table[shape] = path
        path = decode_attention_choice.choose(backend, m.num_heads, m.num_kv_heads,
                                              m.head_dim, block_size, dtype, device)
        if path is not None:
            table[f"decode {shape}"] = path
    return table


def choose(backend, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
           dtype: torch.dtype, device: torch.device) -> str | None:
    """Set `backend`'s bf16 prefill path by measurement; the path, or None where there is
    no choice to make (a path forced, float32, one path only, not the SDPA backend)."""
    if (not isinstance(backend, SdpaAttention) or backend.prefill_path is not None
            or backend.rowwise_prefill or dtype != torch.bfloat16):
        return None
    paths = backend.prefill_paths(dtype, device, head_dim, num_heads // num_kv_heads,
                                  block_size)
    if len(paths) < 2:
        return None
    backend.prefill_path = kernel_choice.choose_attention_path(
        "bf16_prefill_attention", "bf16 prefill attention",
        (num_heads, num_kv_heads, head_dim, block_size), paths,
        lambda: _measure(backend, paths, num_heads, num_kv_heads, head_dim, block_size))
    return backend.prefill_path


@torch.inference_mode()
def _measure(backend: SdpaAttention, paths: list[str], hq: int, hk: int, d: int,
             bs: int) -> str:
    gen = torch.Generator().manual_seed(0)
    meta, blocks = timed_batch(bs)
    t = sum(n for n, _ in TIMED_ROWS)
    k_cache = torch.randn(hk, blocks, bs, d, generator=gen).bfloat16()
    v_cache = torch.randn(hk, blocks, bs, d, generator=gen).bfloat16()
    q = torch.randn(t, hq, d, generator=gen).bfloat16()
    k = torch.randn(t, hk, d, generator=gen).bfloat16()
    v = torch.randn(t, hk, d, generator=gen).bfloat16()

    def candidate(path: str) -> kernel_select.Candidate:
        def load():
            def call():
                backend.prefill_path = path
                return backend(q, k, v, k_cache, v_cache, meta)
            call()
            return call
        return kernel_select.Candidate(path, load)

    try:
        best, _ = kernel_select.fastest(f"bf16 prefill attention [{hq}, {hk}, {d}]",
                                        [candidate(p) for p in paths])
    finally:
        backend.prefill_path = None
    return best


def timed_batch(bs: int) -> tuple[AttentionMetadata, int]:
    """Metadata of one forward of TIMED_ROWS' prefill rows over their own blocks (block 0
    is the padding block, as in the engine), and the number of blocks it needs."""
    tables, slots, query_lens, ctx_lens, seq_lens = [], [], [], [], []
    next_block = 1
    for n, ctx in TIMED_ROWS:
        nb = -(-(ctx + n) // bs)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + n)]
        query_lens.append(n)
        ctx_lens.append(ctx)
        seq_lens.append(ctx + n)
    width = max(len(tb) for tb in tables)
    block_tables = torch.tensor([tb + [0] * (width - len(tb)) for tb in tables],
                                dtype=torch.int32)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        block_tables=block_tables,
        paged_kv_indptr=torch.zeros(len(tables) + 1, dtype=torch.int32),
        paged_kv_indices=torch.zeros(0, dtype=torch.int32),
        paged_kv_last_page_len=torch.zeros(len(tables), dtype=torch.int32),
        num_prefills=len(tables), query_lens_host=query_lens, context_lens_host=ctx_lens,
        seq_lens_host=seq_lens)
    return meta, next_block
