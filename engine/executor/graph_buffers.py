"""Persistent input/output buffers of the decode graphs
(docs/ARCHITECTURE.md, 'The execution trunk', step 4.2).

Allocated once at the largest bucket; every graph is captured over views of these
tensors, so a replay only has to copy the live batch into the same addresses (the
binding). Rows past the live batch are padding: token 0 at position 0, written to slot 0
of the reserved padding block 0, reading a KV length of 1 through a table of block 0
only, so a padding row never touches a real block, whatever a previous step left there.
"""

from __future__ import annotations

import torch

from engine.block_manager import PADDING_BLOCK_ID
from engine.executor.graph_buckets import GraphKey
from engine.forward_input import AttentionMetadata, ForwardInput


class GraphBuffers:
    def __init__(self, max_seqs: int, max_tokens_per_seq: int, max_blocks_per_seq: int,
                 block_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        t, w = max_seqs * max_tokens_per_seq, max_blocks_per_seq
        i32, i64 = torch.int32, torch.int64
        self.max_seqs, self.max_tokens, self.width = max_seqs, t, w
        self.padding_slot = PADDING_BLOCK_ID * block_size
        self.token_ids = torch.zeros(t, dtype=i64, device=device)
        self.positions = torch.zeros(t, dtype=i64, device=device)
        self.slot_mapping = torch.full((t,), self.padding_slot, dtype=i64, device=device)
        self.seq_lens = torch.ones(max_seqs, dtype=i32, device=device)
        self.block_tables = torch.full((max_seqs, w), PADDING_BLOCK_ID, dtype=i32,
                                       device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=i32, device=device)
        self.paged_kv_indptr = torch.zeros(max_seqs + 1, dtype=i32, device=device)
        self.paged_kv_indices = torch.full((max_seqs * w,), PADDING_BLOCK_ID, dtype=i32,
                                           device=device)
        self.paged_kv_last_page_len = torch.ones(max_seqs, dtype=i32, device=device)
        self.hidden = torch.zeros(t, hidden_size, dtype=dtype, device=device)
        # 0, 1, 2, ...: query_start_loc and the padding rows' indptr are multiples of it
        self._steps = torch.arange(max_seqs * w + 1, dtype=i32, device=device)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every persistent tensor by name (their data_ptr never changes)."""
        return {k: v for k, v in vars(self).items()
                if isinstance(v, torch.Tensor) and not k.startswith("_")}

    def metadata(self, key: GraphKey) -> AttentionMetadata:
        """The attention metadata a graph is captured with: views at the key's shapes.
        All rows count as decodes (real or padding rows are the same to the kernels)."""
        b, t = key.num_seqs, key.num_tokens
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[:b + 1],
            block_tables=self.block_tables[:b],
            paged_kv_indptr=self.paged_kv_indptr[:b + 1],
            paged_kv_indices=self.paged_kv_indices[:b * self.width],
            paged_kv_last_page_len=self.paged_kv_last_page_len[:b],
            num_decodes=b, num_prefills=0, num_decode_tokens=t, num_padding=0,
        )

    def bind(self, fi: ForwardInput | None, key: GraphKey) -> None:
        """Copy the live batch (device tensors) into the buffers' first rows and reset the
        rest of the key's rows to padding. `fi=None` binds a batch of padding only (the
        warm-up captures). Only device-side copies and fills: no host sync."""
        b, t, q = key.num_seqs, key.num_tokens, key.tokens_per_seq
        n = m = nt = 0
        if fi is not None:
            a = fi.attn
            n, nt = a.block_tables.shape[0], fi.num_tokens
            m, w = a.paged_kv_indices.shape[0], a.block_tables.shape[1]
            self.token_ids[:nt].copy_(fi.token_ids, non_blocking=True)
            self.positions[:nt].copy_(fi.positions, non_blocking=True)
            self.slot_mapping[:nt].copy_(a.slot_mapping, non_blocking=True)
            self.seq_lens[:n].copy_(a.seq_lens, non_blocking=True)
            self.paged_kv_indptr[:n + 1].copy_(a.paged_kv_indptr, non_blocking=True)
            self.paged_kv_indices[:m].copy_(a.paged_kv_indices, non_blocking=True)
            self.paged_kv_last_page_len[:n].copy_(a.paged_kv_last_page_len,
                                                  non_blocking=True)
        # the whole table first: a live row shorter than the width, or a row a longer
        # batch used before, must read the padding block past its own blocks
        self.block_tables[:b].fill_(PADDING_BLOCK_ID)
        if n:
            self.block_tables[:n, :w].copy_(a.block_tables, non_blocking=True)
        torch.mul(self._steps[:b + 1], q, out=self.query_start_loc[:b + 1])
        if nt < t:
            self.token_ids[nt:t].zero_()
            self.positions[nt:t].zero_()
            self.slot_mapping[nt:t].fill_(self.padding_slot)
        if n < b:
            self.seq_lens[n:b].fill_(1)
            self.paged_kv_last_page_len[n:b].fill_(1)
            # one block (the padding block) per padding row, after the live ones
            torch.add(self._steps[1:b - n + 1], m, out=self.paged_kv_indptr[n + 1:b + 1])
            self.paged_kv_indices[m:m + b - n].fill_(PADDING_BLOCK_ID)
