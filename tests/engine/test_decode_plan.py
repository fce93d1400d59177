"""Width groups of batched decode attention: where the cuts go, and that attention over
groups equals attention over one padded group."""

from __future__ import annotations

import torch

from engine.forward_input import AttentionMetadata
from engine.layers import decode_plan
from engine.layers.decode_plan import build_plan, split_by_width
from engine.layers.kernel_options import KernelOptions
from engine.layers.sdpa_attention import SdpaAttention


def test_split_cuts_where_it_saves_most():
    widths = [30, 1, 2, 31, 1, 29]
    # one group: 6 x 31 = 186 blocks; cut between the short and the long: 3x2 + 3x31 = 99
    assert split_by_width(widths, group_cost=16, max_groups=2) == [[1, 4, 2], [5, 0, 3]]
    # a further cut saves 1 (widths 1,1 | 2) and 2 (29 | 30,31): not worth a group
    assert split_by_width(widths, group_cost=16, max_groups=4) == [[1, 4, 2], [5, 0, 3]]
    assert split_by_width(widths, group_cost=0, max_groups=4) == [[1, 4], [2], [5], [0, 3]]


def test_split_keeps_similar_widths_together():
    assert split_by_width([5, 5, 6, 5], group_cost=16) == [[0, 1, 3, 2]]
    assert split_by_width([7], group_cost=0) == [[0]]
    assert split_by_width([3, 3, 3], group_cost=0) == [[0, 1, 2]]


def _case(seq_lens, rows, bs=4, hk=2, g=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, width = len(seq_lens), max(-(-n // bs) for n in seq_lens)
    nblocks = 1 + b * width
    kc = torch.randn(hk, nblocks, bs, d, generator=gen)
    vc = torch.randn(hk, nblocks, bs, d, generator=gen)
    tables = torch.zeros(b, width, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        used = -(-n // bs)
        tables[i, :used] = torch.randperm(nblocks - 1, generator=gen)[:used] + 1
    q = torch.randn(b * rows, hk * g, d, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32) * rows, block_tables=tables,
        paged_kv_indptr=torch.zeros(b + 1, dtype=torch.int32),
        paged_kv_indices=torch.zeros(0, dtype=torch.int32),
        paged_kv_last_page_len=torch.ones(b, dtype=torch.int32),
        num_decodes=b, num_decode_tokens=b * rows, seq_lens_host=list(seq_lens))
    return q, kc, vc, meta


def test_groups_equal_one_padded_group(monkeypatch):
    lens = [3, 61, 5, 40, 2, 58, 17, 9]
    # the torch path's groups (the C++ kernel reads each row's own length: no groups)
    attn = SdpaAttention(8 ** -0.5, KernelOptions(cpu_attention_kernel=False))
    for rows in (1, 3):
        q, kc, vc, meta = _case(lens, rows, seed=rows)
        monkeypatch.setattr(decode_plan, "GROUP_COST_BLOCKS", 10 ** 9)
        plan = attn.prepare(meta, kc)
        one = attn._decode_rows(q, kc, vc, plan)
        assert len(plan.groups) == 1 and plan.kv_lens is None
        monkeypatch.setattr(decode_plan, "GROUP_COST_BLOCKS", 0)
        plan = attn.prepare(meta, kc)
        many = attn._decode_rows(q, kc, vc, plan)
        groups = plan.groups
        assert len(groups) == decode_plan.MAX_GROUPS
        assert sorted(sum((g.q_rows.tolist() for g in groups), [])) == list(range(len(q)))
        torch.testing.assert_close(many, one, rtol=1e-6, atol=1e-6)
        # and the test can fail: a group's rows written in the wrong order differ
        swapped = many.clone()
        swapped[[0, 1]] = swapped[[1, 0]]
        assert not torch.allclose(swapped, one)


def test_graph_metadata_gets_one_group_from_tensors():
    q, kc, vc, meta = _case([3, 30, 7], 1)
    meta.seq_lens_host = []           # graph buffers carry no host lengths
    plan = build_plan(meta, 3, 1, 4)
    assert len(plan) == 1 and plan[0].q_rows is None and plan[0].width == 8
    assert plan[0].masked.tolist()[0] == [i >= 3 for i in range(32)]
