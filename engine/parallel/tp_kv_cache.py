"""A tensor-parallel rank's KV cache, seen from outside in whole heads.

Each rank keeps the KV heads of its query heads (shard.py). What crosses the engine's
boundary, a PD push read from a prefill node's cache or written into a decode node's, is
in the wire layout of every KV head (engine/kv_cache.py), so prefill and decode nodes of
different tensor-parallel sizes exchange KV as any two nodes do: the layout of a push does
not depend on how either side is split.

- Reads (`gather`, a prefill node's push): a collective. Rank 0 asks the other ranks for
  the same blocks of the same layer (a broadcast they act on between forwards), every rank
  gathers its heads and an all-gather brings them to rank 0, which puts each head in its
  place (a head kept by several ranks is taken once). So the push connector reads the cache
  after the forward, never from a layer's hook in the middle of it (`collective_reads`).
- Writes (`write_blocks`, a decode node's landed push, on a connection thread): rank 0
  writes its own heads at once and queues the whole blocks; the queue goes to the other
  ranks before the next forward (`take_pending`, tp_group's broadcast), and each writes its
  heads. The sequence the blocks belong to runs only after its admission, a command applied
  on the engine thread before that forward, so every rank holds the blocks when it is read.
"""

from __future__ import annotations

import threading

import torch

from engine.kv_cache import KVCache, gather_blocks


def kv_heads_of(rank: int, world: int, num_heads: int, num_kv_heads: int) -> list[int]:
    """The KV heads rank `rank` keeps: those its query heads read (shard.py's split)."""
    groups = num_heads // num_kv_heads
    return sorted({q // groups for q in range(rank * num_heads // world,
                                              (rank + 1) * num_heads // world)})


class TpKvCache(KVCache):
    collective_reads = True

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, dtype, device, rank: int, world: int,
                 ranks=None, v_head_dim: int | None = None):
        """ranks: rank 0's handle (rank_worker.Ranks) for the collectives; None on the other
        ranks, which answer them in their loop. MLA's latent cache (one "head", no V:
        v_head_dim 0) is whole on every rank: all query heads read it."""
        self.heads = [kv_heads_of(r, world, num_heads, num_kv_heads) for r in range(world)]
        super().__init__(num_layers, num_blocks, block_size, len(self.heads[rank]), head_dim,
                         dtype, device, v_head_dim=v_head_dim)
        self.rank, self.world, self.ranks = rank, world, ranks
        self.full_kv_heads = num_kv_heads
        self._pending: list[tuple[int, bool, list[int], torch.Tensor]] = []
        self._lock = threading.Lock()

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block in the wire layout, every KV head."""
        return (self.block_size, self.full_kv_heads, self.head_dim)

    @property
    def v_block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.full_kv_heads, self.v_head_dim)

    # ---- writes: a landed push ----------------------------------------------------------
    def write_blocks(self, layer: int, value: bool, block_ids: list[int],
                     blocks: torch.Tensor) -> None:
        mine = blocks[:, :, self.heads[self.rank]]
        super().write_blocks(layer, value, block_ids, mine)
        with self._lock:       # on the host: the other ranks' devices are their own
            self._pending.append((layer, value, list(block_ids), blocks.to("cpu", copy=True)))

    def take_pending(self) -> list:
        with self._lock:
            pending, self._pending = self._pending, []
        return pending

    def apply(self, writes: list) -> None:
        """Another rank: rank 0's landed blocks, this rank's heads of them."""
        for layer, value, block_ids, blocks in writes:
            super().write_blocks(layer, value, block_ids, blocks[:, :, self.heads[self.rank]])

    # ---- reads: a push from this node ---------------------------------------------------
    def local_blocks(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """This rank's heads of one layer's blocks: [2, n, block_size, heads, head_dim]
        (K alone, [1, ...], for a layout without V)."""
        k = gather_blocks(self.k[layer], block_ids)
        if not self.v_head_dim:
            return k[None]
        return torch.stack((k, gather_blocks(self.v[layer], block_ids)))

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's local_blocks -> [2, n, block_size, all KV heads, head_dim]."""
        two, n, bs, _, d = parts[0].shape
        out = parts[0].new_empty(two, n, bs, self.full_kv_heads, d)
        for heads, part in zip(self.heads, parts, strict=True):
            out[:, :, :, heads] = part
        return out

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: (K, V) of one layer's blocks with every KV head, in the wire layout."""
        full = self.ranks.gather_kv(self, layer, block_ids)
        if not self.v_head_dim:
            return full[0], gather_blocks(self.v[layer], block_ids)    # the empty V
        return full[0], full[1]
