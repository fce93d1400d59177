"""BatchInputBuilder: exact tokens, positions, slot_mapping, block tables, paged-KV
triples, sampling selectors and decode padding; scheduler chunking and preemption."""

from __future__ import annotations

import torch

from engine.block_manager import BlockManager
from engine.input_builder import BatchInputBuilder
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence


def make_seq(tokens, table, cached):
    s = Sequence(list(tokens), SamplingParams(temperature=0.0))
    s.block_table, s.num_cached_tokens = list(table), cached
    return s


def build(items, min_batch=0, threads=0, threshold=512):
    b = BatchInputBuilder(block_size=4, vocab_size=1000, min_decoding_batch_size=min_batch,
                          num_threads=threads, parallel_threshold=threshold)
    out = SchedulerOutput(seqs=[s for s, _ in items], num_new_tokens=[n for _, n in items])
    return b.build_forward_input(out)


def test_decode_first_then_prefill_with_exact_metadata():
    pre = make_seq(range(10, 16), [7, 3], cached=0)          # prefill 6 tokens
    dec = make_seq(range(20, 29), [5, 9, 2], cached=8)       # decode the 9th token
    fi = build([(pre, 6), (dec, 1)])
    assert fi.token_ids.tolist() == [28, 10, 11, 12, 13, 14, 15]
    assert fi.positions.tolist() == [8, 0, 1, 2, 3, 4, 5]
    # slot = block * 4 + offset: pos 8 -> block 2 offset 0; prefill -> blocks 7, 3
    assert fi.attn.slot_mapping.tolist() == [8, 28, 29, 30, 31, 12, 13]
    assert fi.attn.block_tables.tolist() == [[5, 9, 2], [7, 3, 0]]
    assert fi.attn.seq_lens.tolist() == [9, 6]
    assert fi.attn.query_start_loc.tolist() == [0, 1, 7]
    assert fi.attn.paged_kv_indptr.tolist() == [0, 3, 5]
    assert fi.attn.paged_kv_indices.tolist() == [5, 9, 2, 7, 3]
    assert fi.attn.paged_kv_last_page_len.tolist() == [1, 2]
    assert (fi.attn.num_decodes, fi.attn.num_prefills) == (1, 1)
    assert fi.selected_token_idxes.tolist() == [0, 6]
    assert fi.selected_seq_ids == [dec.seq_id, pre.seq_id]


def test_chunk_that_does_not_reach_the_end_is_not_sampled():
    pre = make_seq(range(12), [1, 2, 3], cached=4)           # chunk [4, 8) of 12
    fi = build([(pre, 4)])
    assert fi.positions.tolist() == [4, 5, 6, 7]
    assert fi.attn.slot_mapping.tolist() == [8, 9, 10, 11]
    assert fi.attn.block_tables.tolist() == [[1, 2]]          # only blocks in use
    assert fi.attn.paged_kv_last_page_len.tolist() == [4]
    assert fi.selected_token_idxes.tolist() == [] and fi.sampling is None


def test_decode_padding_rows_point_at_the_padding_block():
    decs = [make_seq(range(5), [4, 6], cached=4), make_seq(range(3), [8], cached=2)]
    fi = build([(s, 1) for s in decs], min_batch=4)
    assert fi.token_ids.tolist() == [4, 2, 0, 0]
    assert fi.attn.slot_mapping.tolist() == [24, 34, 0, 0]
    assert fi.attn.block_tables.tolist() == [[4, 6], [8, 0], [0, 0], [0, 0]]
    assert fi.attn.seq_lens.tolist() == [5, 3, 1, 1]
    assert fi.attn.num_padding == 2
    assert fi.selected_token_idxes.tolist() == [0, 1]           # padding never sampled


def test_threaded_build_merges_by_offset_identically():
    seqs = [make_seq(range(i + 3), [1 + (i + j) % 50 for j in range(-(-(i + 3) // 4))],
                     cached=(i % 2) * (i + 2)) for i in range(40)]
    items = [(s, len(s) - s.num_cached_tokens) for s in seqs]
    serial = build(items)
    threaded = build(items, threads=3, threshold=8)
    for name in ("token_ids", "positions", "selected_token_idxes"):
        assert torch.equal(getattr(serial, name), getattr(threaded, name)), name
    for name in ("slot_mapping", "block_tables", "seq_lens", "paged_kv_indices"):
        assert torch.equal(getattr(serial.attn, name), getattr(threaded.attn, name)), name


def test_scheduler_chunks_prefill_under_the_token_budget():
    bm = BlockManager(num_blocks=32, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, max_model_len=100)
    a = Sequence(list(range(20)), SamplingParams())
    b = Sequence(list(range(50, 53)), SamplingParams())
    sch.add(a)
    sch.add(b)
    plan = [sch.schedule()]
    assert (plan[0].seqs, plan[0].num_new_tokens) == ([a], [8])
    sch.postprocess(plan[0], {}, frozenset())
    out = sch.schedule()
    assert out.num_new_tokens == [8]
    sch.postprocess(out, {}, frozenset())
    out = sch.schedule()                    # a's last 4 tokens, then b's prompt fits
    assert (out.seqs, out.num_new_tokens) == ([a, b], [4, 3])


def test_scheduler_preempts_newest_when_blocks_run_out():
    bm = BlockManager(num_blocks=5, block_size=2)            # 4 usable blocks
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=100)
    a, b = Sequence([1, 2, 3, 4], SamplingParams()), Sequence([4, 5, 6, 7], SamplingParams())
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert out.seqs == [a, b] and bm.num_free_blocks == 0
    sch.postprocess(out, {a.seq_id: 7, b.seq_id: 8}, frozenset())
    out = sch.schedule()        # both need a third block; b (newest) is preempted
    assert out.seqs == [a] and out.preempted == [b]
    assert b.num_cached_tokens == 0 and b.token_ids == [4, 5, 6, 7, 8]
    assert list(sch.waiting) == [b]
