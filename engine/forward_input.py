"""ForwardInput and AttentionMetadata: everything one forward step needs, as tensors.

Built on the host by BatchInputBuilder, moved to the device in one `to(device)` call on
the prepare stream (docs/ARCHITECTURE.md, 'The execution trunk', steps 2.5 and 3).
Host-side integers needed for Python control flow (counts, per-sequence lengths) travel
as plain ints/lists so the forward never syncs on a device tensor to read them.

Row order: decode sequences first, then prefill sequences, then padding rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from engine.sampling_metadata import SamplingMetadata


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] int64: cache slot each new token's K/V goes to
    seq_lens: torch.Tensor            # [B] int32: KV length after this step
    query_start_loc: torch.Tensor     # [B+1] int32: cu_seqlens of the new tokens
    block_tables: torch.Tensor        # [B, W] int32, padded with the padding block 0
    paged_kv_indptr: torch.Tensor     # [B+1] int32
    paged_kv_indices: torch.Tensor    # [sum of blocks] int32
    paged_kv_last_page_len: torch.Tensor  # [B] int32
    num_decodes: int = 0              # leading rows that are single-token decodes
    num_prefills: int = 0
    num_decode_tokens: int = 0
    num_padding: int = 0              # trailing padding rows (decode-only batches)
    # host copies for the per-sequence prefill path
    query_lens_host: list[int] = field(default_factory=list)
    context_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return self.num_prefills == 0

    def to(self, device: torch.device) -> AttentionMetadata:
        return _move(self, device)


@dataclass
class ForwardInput:
    token_ids: torch.Tensor           # [T] int64
    positions: torch.Tensor           # [T] int64
    attn: AttentionMetadata
    selected_token_idxes: torch.Tensor  # [S] int64: rows whose logits are sampled
    sampling: SamplingMetadata | None
    # host-side: seq_id of each selected row, in order
    selected_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def to(self, device: torch.device) -> ForwardInput:
        moved = _move(self, device)
        moved.attn = self.attn.to(device)
        if self.sampling is not None:
            moved.sampling = self.sampling.to(device)
        return moved


def _move(obj, device: torch.device):
    """Copy every tensor field to `device` (non-blocking from pinned/host memory)."""
    if device.type == "cpu":
        return replace(obj)
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value.to(device, non_blocking=True)
    return replace(obj, **changes)
