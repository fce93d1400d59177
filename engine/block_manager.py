"""Paged KV blocks: ref counts, prefix caching by chained hashes, an O(1) LRU free list.

Block 0 is reserved as the padding block: padded rows write their K/V there and nothing
ever reads it, so it is never handed out.

Prefix caching: a full block's hash chains its parent's hash with its tokens, so a hit on
block i implies the whole prefix up to i matches. A hash is registered only once the
block's K/V have been computed (never at allocation), so a concurrent request can never
read a block that is still being filled. Hits are confirmed by comparing tokens.
Freed blocks keep their hash and stay findable until evicted; eviction takes the least
recently freed block first, and a sequence's tail blocks are freed before its head, so
shared prefixes outlive the suffixes that hang off them.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.prefix_hash import chain_hash
from engine.sequence import Sequence

__all__ = ["BlockManager", "PADDING_BLOCK_ID", "chain_hash"]

PADDING_BLOCK_ID = 0


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is padding), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # Front = evicted first. Values unused; OrderedDict gives O(1) remove from middle.
        self.free_queue: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(1, num_blocks))
        self.blocks[PADDING_BLOCK_ID].ref_count = 1   # pinned forever
        # seq_id -> hashes of its blocks registered so far (chain for the next one)
        self._seq_hashes: dict[int, list[int]] = {}
        self.prefix_queries = 0       # tokens looked up
        self.prefix_hits = 0          # tokens found

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute
        (the last prompt token's logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = None
        for i in range((len(seq) - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    # ---- allocation ----------------------------------------------------------------
    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.
        Returns False, changing nothing, when the pool cannot cover it."""
        assert not seq.block_table, f"sequence {seq.seq_id} already has blocks"
        hits = self._match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        new_needed = self.blocks_needed(len(seq)) - len(hits)
        if new_needed > self.num_free_blocks - revived:
            return False
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = hits + [self._take_free() for _ in range(new_needed)]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_prefix_hit_tokens = seq.num_cached_tokens
        self._seq_hashes[seq.seq_id] = [self.blocks[b].hash for b in hits]
        self.prefix_queries += len(seq)
        self.prefix_hits += seq.num_cached_tokens
        return True

    def can_cover(self, seq: Sequence, num_tokens: int) -> bool:
        extra = self.blocks_needed(num_tokens) - len(seq.block_table)
        return extra <= self.num_free_blocks

    def cover(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table so it holds `num_tokens` tokens (caller checked can_cover)."""
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take_free())

    def free(self, seq: Sequence) -> None:
        # Tail first: the tail lands at the front of the LRU queue and is evicted first.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        self._seq_hashes.pop(seq.seq_id, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop blocks beyond `num_tokens` tokens (speculative rollback)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks whose K/V are now fully computed."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        num_full = seq.num_cached_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(hashes[-1] if hashes else None, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = block.block_id
            hashes.append(h)

    def cached_block_hashes(self) -> list[int]:
        return list(self.hash_to_block)

    # ---- internals -----------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:     # evict its cached identity
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id
