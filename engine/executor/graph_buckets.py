"""What shapes the decode graphs have: bucket sizes, graph keys, the executor's options.

docs/ARCHITECTURE.md, 'The execution trunk', step 4.2: batches are bucketed by size into 1 / 2 / 4 /
8, then the next multiple of 16; with padding off every real size gets its own graph.
Buckets count sequences (rows of the block table), where the design the trunk follows
counts tokens: a key's token count is sequences x tokens per sequence, which is 1 for
plain decode and k+1 for a speculative verify of k drafts, so a verify batch keeps whole
sequences together and is bucketed the same way.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class GraphKey:
    """Everything that changes the captured shapes: one graph per distinct key."""
    num_tokens: int            # rows of token ids / positions / slot_mapping / hidden states
    tokens_per_seq: int = 1    # 1: decode; k+1: speculative verify

    @property
    def num_seqs(self) -> int:
        return self.num_tokens // self.tokens_per_seq


def bucket_ladder(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 16, up to the first bucket that holds max_batch_size."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    if max_batch_size <= 8:
        return (*sizes, next(s for s in (1, 2, 4, 8) if s >= max_batch_size))
    return (1, 2, 4, 8, *range(16, max_batch_size + 15, 16))


class GraphBuckets:
    """Maps a batch's sequence count to the bucket it replays in (None: above the limit)."""

    def __init__(self, max_batch_size: int, padding: bool = True,
                 sizes: tuple[int, ...] | None = None):
        self.padding = padding
        self.sizes = tuple(sorted(set(sizes))) if sizes else bucket_ladder(max_batch_size)
        # the decode graph limit: an explicit list says it by its largest entry
        self.limit = self.sizes[-1] if sizes else max_batch_size
        self.largest = self.sizes[-1] if padding else self.limit

    def bucket(self, num_seqs: int) -> int | None:
        if num_seqs < 1 or num_seqs > self.limit:
            return None
        if not self.padding:
            return num_seqs
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def all(self) -> list[int]:
        """Every bucket a batch can land in, smallest first."""
        if not self.padding:
            return list(range(1, self.limit + 1))
        return [s for s in self.sizes if s <= self.largest]


@dataclass(frozen=True)
class GraphOptions:
    max_batch_size: int                  # decode graph limit in sequences
    max_seq_len: int                     # block-table width x block_size; longer: eager
    block_size: int
    padding: bool = True
    batch_sizes: tuple[int, ...] | None = None   # explicit buckets instead of the ladder
    max_tokens_per_seq: int = 1          # k+1 with MTP: verify batches replay too
    warmup_batch_sizes: tuple[int, ...] = ()     # captured at start, largest first

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    @classmethod
    def from_engine_config(cls, config, max_model_len: int) -> GraphOptions:
        return cls(
            max_batch_size=config.graph_max_batch_size or config.max_num_seqs,
            max_seq_len=min(config.graph_max_seq_len or max_model_len, max_model_len),
            block_size=config.block_size,
            padding=config.graph_padding,
            batch_sizes=config.graph_batch_sizes,
            warmup_batch_sizes=config.graph_warmup_batch_sizes,
            # a speculative verify replays k+1 rows per sequence through the same buffers
            max_tokens_per_seq=(config.num_speculative_tokens + 1
                                if getattr(config, "speculative_method", None) else 1),
        )
