"""The two bf16 prefill attention kernels of engine/layers/cpu_prefill_attention.py (the
tile kernel and the brgemm kernel) against an explicit float32 reference: 1-4 query heads
a KV head, blocks of 16 and 32 keys, cached prefixes and prompts that leave partial tiles
and chunks, q read in place from wider rows, NaN in every cache slot no row may read; a
row's bits do not depend on how its prompt was chunked; and, for the brgemm kernel, the
same over random lengths across its 256-key blocks and 64-row tiles (Hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.layers import cpu_prefill_attention
from tests.cpu_features import requires_avx512_bf16, requires_avx512_core

D = 64

# the tile kernel needs AVX512-BF16, the brgemm kernel AVX512 (each available exactly where
# the CPU has it: tests/engine/test_cpu_features.py)
KERNELS = [
    pytest.param(cpu_prefill_attention.prefill_attention, id="tiles",
                 marks=requires_avx512_bf16),
    pytest.param(cpu_prefill_attention.prefill_attention_brgemm, id="brgemm",
                 marks=requires_avx512_core),
]


def _case(seed, ctx, new, hq, hk, bs, width=8):
    """Caches full of NaN but for each sequence's ctx + n keys, over disjoint blocks."""
    g = torch.Generator().manual_seed(seed)
    nblocks = 1 + len(ctx) * width
    kc = torch.full((hk, nblocks, bs, D), float("nan")).bfloat16()
    vc = kc.clone()
    tables = torch.zeros(len(ctx), width, dtype=torch.int32)
    for s, (c, n) in enumerate(zip(ctx, new, strict=True)):
        used = -(-(c + n) // bs)
        tables[s, :used] = torch.arange(1 + s * width, 1 + s * width + used)
        for p in range(c + n):
            blk, off = int(tables[s, p // bs]), p % bs
            kc[:, blk, off] = torch.randn(hk, D, generator=g).bfloat16()
            vc[:, blk, off] = torch.randn(hk, D, generator=g).bfloat16()
    wide = torch.randn(sum(new), hq + 3, D, generator=g).bfloat16()
    q = wide[:, 1:hq + 1]                     # strided rows, as a view into the qkv output
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.long)
    return q, kc, vc, tables, starts, torch.tensor(ctx, dtype=torch.int32)


def _reference(q, kc, vc, tables, starts, ctx, scale):
    hk, bs = kc.shape[0], kc.shape[2]
    g = q.shape[1] // hk
    outs = []
    for s in range(tables.shape[0]):
        c, n = int(ctx[s]), int(starts[s + 1] - starts[s])
        pos = range(c + n)
        keys = torch.stack([kc[:, tables[s, p // bs], p % bs] for p in pos]).float()
        vals = torch.stack([vc[:, tables[s, p // bs], p % bs] for p in pos]).float()
        keys = keys.repeat_interleave(g, dim=1).transpose(0, 1)          # [Hq, L, D]
        vals = vals.repeat_interleave(g, dim=1).transpose(0, 1)
        qs = q[starts[s]:starts[s + 1]].float().transpose(0, 1)           # [Hq, n, D]
        mask = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
        scores = (qs @ keys.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        outs.append((torch.softmax(scores, -1) @ vals).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
@pytest.mark.parametrize("bs", [16, 32])
def test_matches_a_float32_reference(kernel, groups, bs):
    hk = 2
    q, kc, vc, tables, starts, ctx = _case(groups * bs, [0, 5, 16, 40], [1, 23, 8, 70],
                                           hk * groups, hk, bs)
    got = kernel(q, kc, vc, tables, starts, ctx, 0.125)
    ref = _reference(q, kc, vc, tables, starts, ctx, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert torch.isfinite(got.float()).all()          # no NaN slot was read
    # bf16 probabilities and one bf16 rounding of the output
    torch.testing.assert_close(got.float(), ref, rtol=1.6e-2, atol=8e-3)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("new,cut", [(61, 13), (300, 131)])
def test_a_rows_bits_do_not_depend_on_the_chunking(kernel, new, cut):
    """A prompt in one call, and as two chunks (the second call after `cut` cached keys),
    and inside a batch with another prompt: the same bits for every row. 300 rows cross
    the brgemm kernel's 64-row tiles and 256-key blocks at other places in each call."""
    width = -(-(new + 7) // 16)
    q, kc, vc, tables, starts, ctx = _case(5, [0, 7], [new, 30], 6, 2, 16, width)
    whole = kernel(q, kc, vc, tables, starts, ctx, 0.125)
    alone = kernel(q[:new], kc, vc, tables[:1], torch.tensor([0, new]), ctx[:1], 0.125)
    head = kernel(q[:cut], kc, vc, tables[:1], torch.tensor([0, cut]), ctx[:1], 0.125)
    tail = kernel(q[cut:new], kc, vc, tables[:1], torch.tensor([0, new - cut]),
                  torch.tensor([cut], dtype=torch.int32), 0.125)
    assert torch.equal(whole[:new], alone)
    assert torch.equal(alone, torch.cat([head, tail]))


@requires_avx512_core
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_brgemm_kernel_matches_the_reference_on_random_lengths(data):
    """Any mix of cached prefixes and new rows (across 256-key blocks and 64-row tiles),
    1-4 query heads a KV head, any block size: within bf16 rounding of the reference, and
    never a NaN from a slot no row may read."""
    groups = data.draw(st.integers(1, 4), "groups")
    bs = data.draw(st.sampled_from([8, 16, 48]), "block size")
    n_seqs = data.draw(st.integers(1, 3), "sequences")
    ctx = data.draw(st.lists(st.integers(0, 200), min_size=n_seqs, max_size=n_seqs), "ctx")
    new = data.draw(st.lists(st.integers(1, 170), min_size=n_seqs, max_size=n_seqs), "new")
    width = max(-(-(c + n) // bs) for c, n in zip(ctx, new, strict=True))
    q, kc, vc, tables, starts, cx = _case(data.draw(st.integers(0, 2**16), "seed"), ctx, new,
                                          groups, 1, bs, width)
    got = cpu_prefill_attention.prefill_attention_brgemm(q, kc, vc, tables, starts, cx, 0.125)
    ref = _reference(q, kc, vc, tables, starts, cx, 0.125)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), ref, rtol=1.6e-2, atol=8e-3)


@requires_avx512_bf16
def test_refuses_what_it_cannot_serve():
    q, kc, vc, tables, starts, ctx = _case(1, [0], [4], 2, 2, 16)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_prefill_attention.prefill_attention(q, kc, vc, tables, starts,
                                                torch.tensor([126], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_prefill_attention.prefill_attention(q.float(), kc, vc, tables, starts, ctx, 0.1)
    assert not cpu_prefill_attention.usable(torch.bfloat16, D, 1, 8)
    assert not cpu_prefill_attention.usable(torch.float32, D, 1, 16)
    assert not cpu_prefill_attention.brgemm_usable(torch.float32, D, 3)
    assert not cpu_prefill_attention.brgemm_usable(torch.bfloat16, 128, 3)
    assert not cpu_prefill_attention.brgemm_usable(torch.bfloat16, D, 5)


@requires_avx512_core
def test_brgemm_kernel_refuses_what_it_cannot_serve():
    q, kc, vc, tables, starts, ctx = _case(1, [0], [4], 2, 2, 16)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_prefill_attention.prefill_attention_brgemm(
            q, kc, vc, tables, starts, torch.tensor([126], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_prefill_attention.prefill_attention_brgemm(q.float(), kc, vc, tables, starts, ctx,
                                                       0.1)
