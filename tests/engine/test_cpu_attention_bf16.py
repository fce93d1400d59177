"""The C++ paged decode kernel's bfloat16 path for head_dim 64 (AVX512-BF16 dot products,
query heads per KV head fixed at compile time for 1-4, the generic loop beyond): against
an explicit float32 reference on the same bf16 values, for plain decode rows and k+1-row
verify runs, over block tables with partial last blocks."""

from __future__ import annotations

import pytest
import torch

from engine.forward_input import AttentionMetadata
from engine.layers import cpu_paged_attention, cpu_prefill_attention
from engine.layers.kernel_options import KernelOptions
from engine.layers.sdpa_attention import SdpaAttention, verify_kv_lens
from tests.engine.test_spec_graph import _paged_case, _reference


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("rows", [1, 3])
def test_bf16_head_dim_64_matches_reference(groups, rows):
    assert cpu_paged_attention.kernel() is not None, cpu_paged_attention.EXTENSION.failed
    hk = 2
    q, _, _, kc, vc, meta = _paged_case(groups * 10 + rows, [rows + 2, 17, 40, 64], rows,
                                        hq=hk * groups, hk=hk, d=64, bs=16, width=5)
    qb, kb, vb = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    lens = meta.seq_lens if rows == 1 else verify_kv_lens(meta.seq_lens, rows).reshape(-1)
    got = cpu_paged_attention.paged_decode_attention(qb, kb, vb, meta.block_tables,
                                                     lens.to(torch.int32).contiguous(),
                                                     rows, 0.125)
    ref = _reference(qb.float(), kb.float(), vb.float(), meta, rows, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    # float32 arithmetic inside; the one rounding is the output's to bf16 (2^-8 relative)
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=4e-3)


def _prefill_meta(ctx_lens: list[int], new_lens: list[int], bs: int, width: int):
    """Two prompts' prefill rows (the second after `ctx` cached tokens) over disjoint blocks."""
    tables = torch.zeros(len(new_lens), width, dtype=torch.int32)
    slots = []
    for i, (c, n) in enumerate(zip(ctx_lens, new_lens, strict=True)):
        used = -(-(c + n) // bs)
        tables[i, :used] = torch.arange(1 + i * width, 1 + i * width + used)
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(c, c + n)]
    seq_lens = [c + n for c, n in zip(ctx_lens, new_lens, strict=True)]
    starts = torch.tensor([0, *new_lens]).cumsum(0).to(torch.int32)
    zeros = torch.zeros(len(new_lens) + 1, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=starts, block_tables=tables, paged_kv_indptr=zeros,
        paged_kv_indices=zeros, paged_kv_last_page_len=zeros[1:],
        num_decodes=0, num_prefills=len(new_lens), num_decode_tokens=0,
        query_lens_host=list(new_lens), context_lens_host=list(ctx_lens),
        seq_lens_host=seq_lens)


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("path", ["tiles", "rows"])
def test_bf16_prefill_through_the_kernels_matches_sdpa(groups, path, monkeypatch):
    """In bf16 with head_dim 64 (where the kernels have their AVX512-BF16 paths) prefill
    rows go through the tiled prefill kernel, or with it switched off through the decode
    kernel one row at a time; either result is SDPA's within bf16 rounding, with a cached
    prefix too."""
    hk, d, bs, width = 2, 64, 16, 8
    g = torch.Generator().manual_seed(groups)
    ctx, new = [0, 21], [37, 50]
    meta = _prefill_meta(ctx, new, bs, width)
    t = sum(new)
    q = torch.randn(t, hk * groups, d, generator=g).bfloat16()
    k = torch.randn(t, hk, d, generator=g).bfloat16()
    v = torch.randn(t, hk, d, generator=g).bfloat16()
    if path == "tiles":
        module, fn, options = cpu_prefill_attention, "prefill_attention", KernelOptions()
        fast_here = cpu_prefill_attention.usable(torch.bfloat16, d, groups, bs)
    else:
        module, fn = cpu_paged_attention, "paged_decode_attention"
        options = KernelOptions(cpu_prefill_tiles=False)
        fast_here = cpu_paged_attention.fast_bf16_rows(torch.bfloat16, d, groups)
    outs = {}
    for name, kernels in (("kernel", options), ("sdpa", KernelOptions.torch_only())):
        cache = torch.randn(2, hk, 1 + 2 * width, bs, d, generator=torch.Generator()
                            .manual_seed(7)).bfloat16()       # the cached prefix: random
        calls = []
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn,
                            lambda *a, real=real, calls=calls: calls.append(1) or real(*a))
        with torch.inference_mode():
            outs[name] = SdpaAttention(0.125, kernels)(q, k, v, cache[0], cache[1], meta)
        monkeypatch.undo()
        # without AVX512-BF16 (an AVX2 CPU) prefill stays on SDPA
        assert bool(calls) == (name == "kernel" and fast_here)
    torch.testing.assert_close(outs["kernel"].float(), outs["sdpa"].float(),
                               rtol=1.6e-2, atol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 32])
def test_the_kernel_reads_q_in_place_from_the_fused_qkv_rows(dtype, d):
    """q as the attention layer hands it over: a view of the fused qkv output, whose rows
    are wider than q's heads. The kernel reads it with its row stride (no copy) and gives
    the same bits as for a contiguous copy."""
    assert cpu_paged_attention.kernel() is not None, cpu_paged_attention.EXTENSION.failed
    hq, hk = 6, 2
    q, _, _, kc, vc, meta = _paged_case(d, [3, 17, 40], 1, hq=hq, hk=hk, d=d, bs=16,
                                        width=3)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    qkv = torch.randn(q.shape[0], (hq + 2 * hk) * d).to(dtype)
    qkv[:, :hq * d] = q.reshape(q.shape[0], -1)
    view = qkv[:, :hq * d].view(q.shape[0], hq, d)
    assert not view.is_contiguous()
    lens = meta.seq_lens.to(torch.int32).contiguous()
    got = cpu_paged_attention.paged_decode_attention(view, kc, vc, meta.block_tables, lens,
                                                     1, 0.125)
    want = cpu_paged_attention.paged_decode_attention(q.contiguous(), kc, vc,
                                                      meta.block_tables, lens, 1, 0.125)
    assert got.is_contiguous() and torch.equal(got, want)
    ref = _reference(q.float(), kc.float(), vc.float(), meta, 1, 0.125)
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=4e-3)
