"""The tiled bf16 prefill attention kernel (engine/layers/cpu_prefill_attention.py) against
an explicit float32 reference: 1-4 query heads a KV head, blocks of 16 and 32 keys,
cached prefixes and prompts that leave partial tiles and chunks, q read in place from
wider rows, NaN in every cache slot no row may read; and a row's bits do not depend on
how its prompt was chunked."""

from __future__ import annotations

import pytest
import torch

from engine.layers import cpu_prefill_attention
from tests.cpu_features import requires_avx512_bf16

D = 64


# the kernel needs AVX512-BF16 (available exactly where the CPU has it:
# tests/engine/test_cpu_features.py)
pytestmark = requires_avx512_bf16


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


@pytest.mark.parametrize("groups", [1, 2, 3, 4])
@pytest.mark.parametrize("bs", [16, 32])
def test_matches_a_float32_reference(groups, bs):
    hk = 2
    q, kc, vc, tables, starts, ctx = _case(groups * bs, [0, 5, 16, 40], [1, 23, 8, 70],
                                           hk * groups, hk, bs)
    got = cpu_prefill_attention.prefill_attention(q, kc, vc, tables, starts, ctx, 0.125)
    ref = _reference(q, kc, vc, tables, starts, ctx, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert torch.isfinite(got.float()).all()          # no NaN slot was read
    # bf16 probabilities and one bf16 rounding of the output
    torch.testing.assert_close(got.float(), ref, rtol=1.6e-2, atol=8e-3)


def test_a_rows_bits_do_not_depend_on_the_chunking():
    """A 61-token prompt in one call, and as 13 + 48 rows (the second call after 13
    cached keys), and inside a batch with another prompt: the same bits for every row."""
    q, kc, vc, tables, starts, ctx = _case(5, [0, 7], [61, 30], 6, 2, 16)
    whole = cpu_prefill_attention.prefill_attention(q, kc, vc, tables, starts, ctx, 0.125)
    alone = cpu_prefill_attention.prefill_attention(
        q[:61], kc, vc, tables[:1], torch.tensor([0, 61]), ctx[:1], 0.125)
    head = cpu_prefill_attention.prefill_attention(
        q[:13], kc, vc, tables[:1], torch.tensor([0, 13]), ctx[:1], 0.125)
    tail = cpu_prefill_attention.prefill_attention(
        q[13:61], kc, vc, tables[:1], torch.tensor([0, 48]),
        torch.tensor([13], dtype=torch.int32), 0.125)
    assert torch.equal(whole[:61], alone)
    assert torch.equal(alone, torch.cat([head, tail]))


def test_refuses_what_it_cannot_serve():
    q, kc, vc, tables, starts, ctx = _case(1, [0], [4], 2, 2, 16)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_prefill_attention.prefill_attention(q, kc, vc, tables, starts,
                                                torch.tensor([126], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_prefill_attention.prefill_attention(q.float(), kc, vc, tables, starts, ctx, 0.1)
    assert not cpu_prefill_attention.usable(torch.bfloat16, D, 1, 8)
    assert not cpu_prefill_attention.usable(torch.float32, D, 1, 16)
