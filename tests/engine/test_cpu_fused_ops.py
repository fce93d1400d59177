"""The fused CPU decoder ops against the torch ops they replace.

rope_ and write_kv must be bit-identical (float32 and bfloat16); add_rms_norm (used for
bfloat16 only) may differ from torch's in the last bit where its float32 sum runs in
another order, which bfloat16's rounding nearly always absorbs: two bfloat16 ulps at most,
and almost every element equal. Calls over more than PAR_ROWS (8) rows split their rows over
torch's threads; the row counts here run both ways.
"""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import write_slots
from engine.layers import cpu_fused_ops
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_fused_ops.EXTENSION.load() is not None, cpu_fused_ops.EXTENSION.failed


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 ulps (same-sign values: the bit patterns' difference)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ai - bi).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 32), (2, 1, 128)])
@pytest.mark.parametrize("t", [5, 37, 1000])
def test_rope_matches_the_torch_rotary_bitwise(dtype, heads, kv_heads, head_dim, t):
    g = torch.Generator().manual_seed(heads * head_dim)
    rot = RotaryEmbedding(head_dim, 4096, 10000.0)
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=g)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    cos, sin = rot.lookup(positions, dtype)
    want = rot.rotate(qk, cos, sin)
    got = qkv.clone()
    with torch.inference_mode():
        cpu_fused_ops.rope_(got, positions, rot.cos, rot.sin_signed, heads + kv_heads,
                            head_dim)
    rotated = got[:, :(heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    assert torch.equal(rotated, want)
    # V is left alone
    assert torch.equal(got[:, (heads + kv_heads) * head_dim:],
                       qkv[:, (heads + kv_heads) * head_dim:])


def test_rope_rejects_a_position_outside_the_table():
    rot = RotaryEmbedding(8, 16, 10000.0)
    qkv = torch.zeros(2, 3 * 8)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        cpu_fused_ops.rope_(qkv, torch.tensor([3, 16]), rot.cos, rot.sin_signed, 2, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [9, 600])
def test_write_kv_equals_index_copy(dtype, t):
    g = torch.Generator().manual_seed(1)
    hk, blocks, bs, d = 3, 200, 4, 16
    kc, vc = (torch.randn(hk, blocks, bs, d, generator=g).to(dtype) for _ in range(2))
    qkv = torch.randn(t, (4 + 2 * hk) * d, generator=g).to(dtype)     # strided k and v
    k = qkv[:, 4 * d:(4 + hk) * d].view(t, hk, d)
    v = qkv[:, (4 + hk) * d:].view(t, hk, d)
    slots = torch.randperm(blocks * bs, generator=g)[:t]
    want_k, want_v = kc.clone(), vc.clone()
    write_slots(want_k, slots, k)
    write_slots(want_v, slots, v)
    cpu_fused_ops.write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_fused_ops.write_kv(k, v, kc, vc, torch.full((t,), blocks * bs))


@pytest.mark.parametrize("hidden,rows", [(576, 1), (576, 32), (64, 300), (960, 2048)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_bf16_within_two_ulps_of_torch(hidden, rows, with_residual):
    g = torch.Generator().manual_seed(hidden + rows)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=g) * 0.5 + 1
    norm.bfloat16()
    x = (torch.randn(rows, hidden, generator=g) * 3).bfloat16()
    res = (torch.randn(rows, hidden, generator=g) * 3).bfloat16() if with_residual else None
    total = x + res if with_residual else x
    want = norm.weight * torch.rms_norm(total.float(), (hidden,), eps=1e-5).bfloat16()
    out, got_total = cpu_fused_ops.add_rms_norm(x, res, norm.weight, 1e-5)
    assert torch.equal(got_total, total)           # the residual add is exact
    # a last-bit difference in rstd can move the normalised value one ulp, and the
    # product with the weight (rounded again) one more; about 2 elements in 10,000 differ
    ulps = _ulps(out, want)
    assert int(ulps.max()) <= 2
    assert float((ulps == 0).float().mean()) > 0.999
    # rows are independent: split over threads or not, every row has the same bits
    parts = [cpu_fused_ops.add_rms_norm(x[i:i + 100], None if res is None else res[i:i + 100],
                                        norm.weight, 1e-5)[0] for i in range(0, rows, 100)]
    assert torch.equal(out, torch.cat(parts))


def test_fits_only_cpu_inference_in_its_dtypes():
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert cpu_fused_ops.fits(x, cpu_fused_ops.NEAR_DTYPES)
        assert not cpu_fused_ops.fits(x.float(), cpu_fused_ops.NEAR_DTYPES)
        assert cpu_fused_ops.fits(x.float(), cpu_fused_ops.EXACT_DTYPES)
        assert not cpu_fused_ops.fits(x.to("meta"), cpu_fused_ops.EXACT_DTYPES)
    assert not cpu_fused_ops.fits(x, cpu_fused_ops.EXACT_DTYPES)   # autograd on: torch


def test_add_rms_norm_refuses_float32():
    """float32 keeps torch's norm (bit-equal to HF's): the kernel takes bfloat16 only."""
    x = torch.ones(2, 8)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_fused_ops.add_rms_norm(x, None, torch.ones(8), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 31, 32, 100, 49152])
def test_argmax_rows_gives_torch_argmax_indices(dtype, n):
    """Random rows, then the cases a lane-wise maximum can get wrong: the maximum repeated
    (the first index wins), in the tail past the last 16 lanes, at index 0, a NaN (the
    first NaN wins), -inf everywhere, one row of equal values, and a strided row view."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(12, n, generator=g).to(dtype)
    top = x.abs().max() + 1
    x[1, n // 2:] = top                                  # ties: the first one
    x[2, -1] = top                                       # in the tail
    x[3, 0] = top
    x[4, n // 3] = float("nan")
    x[4, -1] = float("nan")
    x[9, 0] = float("nan")                               # a NaN first
    x[5] = float("-inf")
    x[6] = 0.5
    x[7, :] = -top
    x[7, n - 1 - n // 4] = -top + 1
    x[8, n // 2] = -0.0
    x[8, :n // 2] = 0.0
    x[8, n // 2 + 1:] = -1.0
    wide = torch.randn(12, n + 5, generator=g).to(dtype)
    for rows in (x, wide[:, 2:n + 2]):
        assert torch.equal(cpu_fused_ops.argmax_rows(rows), rows.argmax(dim=-1))


def test_sampler_greedy_rows_take_the_kernel(monkeypatch):
    """The Worker's sampler (cpu_argmax on with the fused ops) routes greedy argmax through
    the kernel and gets torch's tokens; a sampler without it keeps torch's argmax."""
    from engine.sampler import Sampler
    from engine.sampling_metadata import SamplingMetadata
    from engine.sampling_params import SamplingParams
    logits = torch.randn(9, 500, generator=torch.Generator().manual_seed(3))
    meta = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 9, [[1]] * 9, [[]] * 9,
                                  [None] * 9, 500)
    calls = []
    real = cpu_fused_ops.argmax_rows
    monkeypatch.setattr(cpu_fused_ops, "argmax_rows", lambda x: calls.append(1) or real(x))
    with torch.inference_mode():
        fast = Sampler(cpu_argmax=True)(logits, meta).next_tokens
        plain = Sampler()(logits, meta).next_tokens
    assert calls == [1]
    assert torch.equal(fast, logits.argmax(dim=-1)) and torch.equal(plain, fast)
