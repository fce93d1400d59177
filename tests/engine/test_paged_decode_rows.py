"""The bf16 paged decode kernel (head_dim 64: the AVX512-BF16 path where the CPU has it, the
generic loop elsewhere, and the path that scores on AMX tiles where the CPU has those; the
same properties hold for all) over batches Hypothesis draws:
rows of unequal lengths (0 keys included), blocks scattered through the cache, 1-4 query
heads a KV head, one or two threads. The kernel splits its (row, KV head) items over the
threads by their keys and prefetches the next item's blocks, so what must hold is:

- every row matches a float32 reference on the same bf16 values;
- a row's bits do not depend on the rest of the batch or on the thread count (the split
  moves rows between threads; batch-invariant decoding relies on this);
- a row with no keys (a padded row) is zeros, not NaN."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.layers import cpu_paged_attention
from tests.cpu_features import requires_amx_bf16

D, BS, HK = 64, 16, 2


def _reference(q, kc, vc, tables, lens, scale, rows=1):
    """Attention of each row over its first `lens[r]` keys, in float32 (zeros for none);
    `rows` consecutive rows a sequence share its block table (a verify run)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    g = q.shape[1] // HK
    for r, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        blocks = tables[r // rows, :math.ceil(n / BS)].long()
        k = kc[:, blocks].reshape(HK, -1, D)[:, :n].float()     # [HK, n, D]
        v = vc[:, blocks].reshape(HK, -1, D)[:, :n].float()
        qr = q[r].float().view(HK, g, D)
        p = torch.softmax(qr @ k.transpose(1, 2) * scale, dim=-1)  # [HK, g, n]
        out[r] = (p @ v).reshape(-1, D)
    return out


def _batch(seed: int, lens: list[int], groups: int, dtype=torch.bfloat16):
    """q, caches and block tables with each row's blocks at random places in the cache."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / BS) for n in lens]
    width = max(1, *need)
    nblocks = sum(need) + 3
    kc = torch.randn(HK, nblocks, BS, D, generator=gen).to(dtype)
    vc = torch.randn(HK, nblocks, BS, D, generator=gen).to(dtype)
    order = torch.randperm(nblocks, generator=gen)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        tables[r, :n] = order[used:used + n].int()
        used += n
    q = torch.randn(len(lens), HK * groups, D, generator=gen).to(dtype)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


def _run(q, kc, vc, tables, lens, path="vector"):
    return cpu_paged_attention.paged_decode_attention(q, kc, vc, tables, lens, 1, 0.125, path)


PATHS = ["vector", pytest.param("amx", marks=requires_amx_bf16)]


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    assert cpu_paged_attention.kernel() is not None, cpu_paged_attention.EXTENSION.failed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16),
       lens=st.lists(st.integers(0, 200), min_size=1, max_size=12),
       groups=st.integers(1, 4),
       threads=st.sampled_from([1, 2]))
@pytest.mark.parametrize("path", PATHS)
def test_rows_match_reference_and_do_not_depend_on_the_batch(path, seed, lens, groups, threads):
    q, kc, vc, tables, kv_lens = _batch(seed, lens, groups)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _run(q, kc, vc, tables, kv_lens, path)
        alone = [_run(q[r:r + 1], kc, vc, tables[r:r + 1], kv_lens[r:r + 1], path)
                 for r in range(len(lens))]
    finally:
        torch.set_num_threads(before)
    assert not torch.isnan(got).any()
    # float32 inside; the one rounding is the output's to bf16 (2^-8 relative)
    torch.testing.assert_close(got.float(), _reference(q, kc, vc, tables, kv_lens, 0.125),
                               rtol=8e-3, atol=4e-3)
    for r, n in enumerate(lens):
        assert torch.equal(got[r], alone[r][0]), f"row {r} ({n} keys) changed with its batch"
        if n == 0:
            assert torch.equal(got[r], torch.zeros_like(got[r])), "a row without keys"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_thread_count_does_not_change_bits(dtype):
    """The same batch on one thread and on two: the split by keys moves rows between
    threads, never changes a row's arithmetic."""
    q, kc, vc, tables, kv_lens = _batch(7, [5, 300, 17, 0, 129, 64, 1, 250], 3, dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(q, kc, vc, tables, kv_lens)
        torch.set_num_threads(2)
        two = _run(q, kc, vc, tables, kv_lens)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(one[3], torch.zeros_like(one[3]))   # the row without keys


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16),
       lens=st.lists(st.integers(0, 200), min_size=1, max_size=10),
       groups=st.integers(1, 5), rows=st.integers(1, 4), threads=st.sampled_from([1, 2]))
def test_float32_rows_match_reference_in_verify_runs_and_alone(seed, lens, groups, rows,
                                                               threads):
    """Float32 (the AVX2 path for 1-4 query heads a KV head, the generic loop for 5): each
    row matches the float32 reference to rounding, verify runs of `rows` rows a sequence
    included (row j of a run sees its sequence's keys up to itself), and a sequence's rows
    have the same bits alone as in the batch."""
    q, kc, vc, tables, kv_lens = _batch(seed, lens, groups, torch.float32)
    shift = torch.randn(len(lens) * rows, 1, 1, generator=torch.Generator().manual_seed(seed))
    q = q.repeat_interleave(rows, dim=0) + shift.mul(0.1)       # verify rows differ
    row_lens = torch.tensor([max(0, n - rows + 1 + j) for n in lens for j in range(rows)],
                            dtype=torch.int32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_paged_attention.paged_decode_attention(q, kc, vc, tables, row_lens, rows,
                                                         0.125, "vector")
        alone = [cpu_paged_attention.paged_decode_attention(
            q[s * rows:(s + 1) * rows], kc, vc, tables[s:s + 1],
            row_lens[s * rows:(s + 1) * rows], rows, 0.125, "vector") for s in range(len(lens))]
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.float32 and not torch.isnan(got).any()
    torch.testing.assert_close(got, _reference(q, kc, vc, tables, row_lens, 0.125, rows),
                               rtol=1e-4, atol=1e-5)
    for s in range(len(lens)):
        assert torch.equal(got[s * rows:(s + 1) * rows], alone[s]), f"sequence {s}"
    assert not got[row_lens == 0].any(), "a row without keys is zeros"


@pytest.mark.parametrize("path", PATHS)
def test_a_negative_or_missing_length_is_an_error_not_a_crash(path):
    q, kc, vc, tables, kv_lens = _batch(3, [20, 40], 2)
    with pytest.raises(RuntimeError, match="kv length -1 of row 1"):
        _run(q, kc, vc, tables, torch.tensor([20, -1], dtype=torch.int32), path)
    with pytest.raises(RuntimeError, match="a kv length for every row"):
        _run(q, kc, vc, tables, kv_lens[:1], path)


@requires_amx_bf16
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16),
       lens=st.lists(st.integers(0, 300), min_size=1, max_size=8),
       groups=st.integers(1, 4), rows=st.integers(1, 4))
def test_the_tile_path_agrees_with_the_vector_path(seed, lens, groups, rows):
    """The two paths differ only in how a score's 64 products are summed (the V pass is the
    same FMAs in the same order), so their outputs agree to within a bf16 rounding step,
    verify runs of `rows` rows a sequence included."""
    q, kc, vc, tables, kv_lens = _batch(seed, lens, groups)
    q = q.repeat_interleave(rows, dim=0)
    row_lens = torch.tensor([max(0, n - rows + 1 + j) for n in lens for j in range(rows)],
                            dtype=torch.int32)
    got, want = (cpu_paged_attention.paged_decode_attention(q, kc, vc, tables, row_lens, rows,
                                                            0.125, p) for p in ("amx", "vector"))
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=4e-3)
