"""Per-layer K/V cache tensors, addressed by slot = block_id * block_size + offset.

Layout per layer, K and V alike: [num_kv_heads, num_blocks, block_size, head_dim]
(head-major). Gathering a batch's blocks along dim 1 gives [Hkv, B, W*block_size, D]
directly, which is the batched-matmul layout decode attention wants: no transposing copy
of the gathered keys (3x faster CPU decode attention at KV 512 than a block-major cache,
measured in bench/offline_throughput.py's decode step).

Everything outside attention sees blocks in the block-major wire layout
[n, block_size, num_kv_heads, head_dim] through `gather_blocks` / `scatter_blocks`
(KV push, MTP handoff), so the layout stays a private detail of this file and the
attention backend.
"""

from __future__ import annotations

import math
import mmap

import torch

from engine.huge_pages import anonymous_mapping

BLOCK_DIM = 1     # the block axis of a layer's cache tensor


class KVCache:
    # a read of whole blocks needs every tensor-parallel rank (engine/parallel/
    # tp_kv_cache.py): never from inside a forward
    collective_reads = False

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 v_head_dim: int | None = None, prefault: bool = False,
                 huge_pages: bool = False):
        """v_head_dim: V's width when it differs from K's; 0 for MLA's latent cache, whose
        one row a token (kv_lora_rank + rope values) is all K (engine/models/mla.py).
        prefault: on a CPU, every page mapped now (`zeroed`; EngineConfig.prefault_memory).
        huge_pages: on a CPU, on 2 MB pages where the OS has them (EngineConfig.huge_pages)."""
        v_dim = head_dim if v_head_dim is None else v_head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.v_head_dim = num_kv_heads, head_dim, v_dim
        self.k = [zeroed((num_kv_heads, num_blocks, block_size, head_dim), dtype, device,
                         prefault, huge_pages) for _ in range(num_layers)]
        self.v = [zeroed((num_kv_heads, num_blocks, block_size, v_dim), dtype, device,
                         prefault, huge_pages) for _ in range(num_layers)]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of K in the wire layout: (block_size, num_kv_heads, head_dim)."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def v_block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.v_head_dim)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, v_head_dim: int | None = None) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        v_dim = head_dim if v_head_dim is None else v_head_dim
        return num_layers * block_size * num_kv_heads * (head_dim + v_dim) * elem

    def write_blocks(self, layer: int, value: bool, block_ids: list[int],
                     blocks: torch.Tensor) -> None:
        """Copy whole blocks in, as a PD push delivers them: `blocks` [len(block_ids),
        block_size, kv_heads, head_dim] into the K (value=False) or V cache of `layer`.
        Safe from another thread while the engine runs, when the blocks belong to a
        sequence awaiting its KV (no step reads or writes them)."""
        cache = (self.v if value else self.k)[layer]
        first = block_ids[0]
        if block_ids == list(range(first, first + len(block_ids))):    # one run: a slice
            cache[:, first:first + len(block_ids)].copy_(blocks.permute(2, 0, 1, 3))
        else:
            idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
            scatter_blocks(cache, idx, blocks.to(cache.device, non_blocking=False))

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer's blocks in the wire layout (a PD push)."""
        return gather_blocks(self.k[layer], block_ids), gather_blocks(self.v[layer], block_ids)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]


# madvise(MADV_POPULATE_WRITE), Linux 5.14+; Python's mmap module names it from 3.13 on
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           prefault: bool = False, huge_pages: bool = False) -> torch.Tensor:
    """A zero tensor. On CPU it lies in an anonymous mapping, whose pages the kernel maps to
    its shared zero page until first written: a 2 GB cache costs memory only as blocks are
    used (torch.zeros writes every page at start, so the whole cache was resident from
    the first second). Zeros, not garbage, because masked attention still multiplies the
    unused slots of a gathered block by zero weights, and 0 * NaN is NaN.

    prefault: map every page now instead of at its first write. Why (issue 36): a served
    step that writes KV into blocks never used before takes a page fault per 4 KB, and in
    a VM a page's first touch can cost ~9 us (the host backs it then): on a 2-core Xeon VM
    a 16-prompt x 256-token prefill step faulted ~22k KV pages, ~8% of the step, and the
    decode node as many again where the push landed, until the pool had been cycled once
    (blocks are handed out least recently freed first, so each is new once). vLLM writes
    its cache at start for the same reason. The cost moves to the start (~1.7 s a GB
    there) and the cache is resident from then on, as its size says: a node short of
    memory fails at start, not mid-request. The kernel zeroes the pages; where the madvise
    is missing (Linux before 5.14) writing the zeros does the same.

    huge_pages: the mapping advised to take 2 MB pages (engine/huge_pages.py: decode
    attention streams the cache, and scattered blocks cost a TLB miss each on 4 KB pages)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = anonymous_mapping(nbytes, huge_pages)
    # the tensor keeps the mapping alive (frombuffer holds the buffer it views)
    t = torch.frombuffer(buf, dtype=dtype).view(shape)
    if prefault:
        try:
            buf.madvise(MADV_POPULATE_WRITE)
        except OSError:
            t.zero_()
    return t


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks `block_ids` of one layer's K or V, as a contiguous
    [n, block_size, num_kv_heads, head_dim] tensor (the wire layout). One copy: the
    selection from the cache seen in the wire layout (index_select then permute and
    contiguous copied twice, 28 against 12 us a call for a 256-token prompt's blocks of
    SmolLM2, 960 calls in a 16-prompt prefill step's push)."""
    return cache.permute(1, 2, 0, 3).index_select(0, block_ids)


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor) -> None:
    """Write `data` [n, block_size, num_kv_heads, head_dim] into blocks `block_ids`."""
    cache.index_copy_(BLOCK_DIM, block_ids, data.permute(2, 0, 1, 3))


def write_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Write per-token rows [T, num_kv_heads, head_dim] into their slots."""
    hk, _, _, d = cache.shape
    cache.view(hk, -1, d).index_copy_(1, slot_mapping, rows.transpose(0, 1))
