"""BlockManager: exact block ids, prefix hits with token check, ref counts, LRU eviction
order (tails first), the reserved padding block."""

from __future__ import annotations

import pytest

from engine.block_manager import PADDING_BLOCK_ID, BlockManager, chain_hash
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(tokens):
    return Sequence(list(tokens), SamplingParams())


def computed(bm: BlockManager, s: Sequence) -> None:
    """Pretend the whole sequence's KV was computed."""
    s.num_cached_tokens = len(s)
    bm.cache_full_blocks(s)


def test_allocate_takes_lowest_free_blocks_and_never_padding():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))                     # 3 blocks
    assert bm.allocate(a)
    assert a.block_table == [1, 2, 3]
    assert PADDING_BLOCK_ID not in a.block_table
    assert bm.num_free_blocks == 4
    b = seq(range(100, 117))               # 5 blocks > 4 free
    assert not bm.allocate(b)
    assert b.block_table == [] and bm.num_free_blocks == 4   # nothing changed


def test_prefix_hit_reuses_computed_blocks_and_checks_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(10))
    bm.allocate(a)
    # before a's KV is computed nothing is registered: no hit possible
    b = seq(range(10))
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    bm.free(b)
    computed(bm, a)                        # blocks 1, 2 full -> registered; 3 partial
    c = seq(list(range(8)) + [50, 51, 52])
    assert bm.allocate(c)
    assert c.block_table[:2] == a.block_table[:2]
    assert c.num_cached_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    # same hash, different tokens (forced collision): token check rejects the hit
    bm.blocks[a.block_table[0]].token_ids = (9, 9, 9, 9)
    d = seq(range(10))
    bm.allocate(d)
    assert d.num_cached_tokens == 0


def test_full_prompt_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(8))
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(8))                      # both blocks cached, but logits are needed
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_freed_blocks_stay_findable_until_evicted_tail_first():
    bm = BlockManager(num_blocks=7, block_size=2)      # 6 usable blocks
    a = seq(range(6))                                  # blocks 1, 2, 3
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    # LRU order: tail (3) first, then 2, then 1; untouched 4, 5, 6 were free earlier
    assert list(bm.free_queue) == [4, 5, 6, 3, 2, 1]
    b = seq(range(5))                                  # hits blocks 1, 2 (4 tokens)
    bm.allocate(b)
    assert b.block_table == [1, 2, 4] and b.num_cached_tokens == 4
    bm.free(b)
    # a request needing everything evicts the cached blocks, oldest-freed first
    c = seq(range(100, 112))
    bm.allocate(c)
    assert c.block_table == [5, 6, 3, 4, 2, 1]
    assert bm.hash_to_block == {}


def test_ref_counts_and_double_free_detection():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(9))
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(9))
    bm.allocate(b)
    shared = a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert all(i not in bm.free_queue for i in shared)
    bm.free(b)
    assert bm.num_free_blocks == 7
    b.block_table = shared
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(b)


def test_cover_and_truncate_grow_and_shrink_the_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(4))
    bm.allocate(a)
    assert bm.can_cover(a, 12)
    bm.cover(a, 12)
    assert a.block_table == [1, 2, 3]
    bm.truncate(a, 5)
    assert a.block_table == [1, 2] and 3 in bm.free_queue
    assert not bm.can_cover(a, 4 * 8)


def test_chain_hash_depends_on_parent():
    assert chain_hash(None, (1, 2)) != chain_hash(chain_hash(None, (0, 0)), (1, 2))


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    a = seq(range(10))
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(10))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and bm.hash_to_block == {}
