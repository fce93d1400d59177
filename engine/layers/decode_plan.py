"""The per-forward plan of batched decode attention: width groups and their masks.

Decode attention gathers every sequence's blocks into a dense [Hkv, B, W*block_size, D]
tensor and runs two batched matmuls over it, so its cost grows with B x W, W the widest
block table of the batch. In a mixed batch (sequences of 30 and 700 tokens side by side)
most of that area is padding. When the host knows each sequence's length (eager
forwards), the decode rows are sorted by width and cut into a few groups, each gathered
at its own width: about 40% less gathered area on uniformly mixed lengths, for a handful
of extra small ops per group and layer.

The plan (row indices, flattened block ids, masks) is built once per forward and reused
by every layer. Graph forwards carry no host lengths (their metadata is the captured
buffers'): they get one group built from the tensors, recomputed at every call, so a
replay never sees a stale mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_input import AttentionMetadata

# Extra cost of one more group, in gathered block-rows (one sequence x one block): a group
# adds ~12 small ops per layer (~60 us), about what gathering and attending ~16 blocks of
# one sequence costs on a CPU core (measured on SmolLM2's shapes).
GROUP_COST_BLOCKS = 16
MAX_GROUPS = 4


@dataclass
class DecodeGroup:
    q_rows: torch.Tensor | None   # rows of q in this group; None: all decode rows, in order
    block_ids: torch.Tensor       # [b * w] the group's block tables, flattened
    num_seqs: int
    width: int                    # blocks per sequence
    masked: torch.Tensor          # bool, True where a score is masked out: [b, L] or [b, Q, L]


def split_by_width(widths: list[int], group_cost: int | None = None,
                   max_groups: int | None = None) -> list[list[int]]:
    """Sequence indices cut into groups of similar width, widest group last; each cut is
    made where it saves the most gathered area and only while it saves > group_cost
    (default GROUP_COST_BLOCKS, read at call time)."""
    group_cost = GROUP_COST_BLOCKS if group_cost is None else group_cost
    max_groups = MAX_GROUPS if max_groups is None else max_groups
    order = sorted(range(len(widths)), key=widths.__getitem__)
    w = [widths[i] for i in order]
    spans = [(0, len(w))]
    while len(spans) < max_groups:
        best = None
        for gi, (lo, hi) in enumerate(spans):
            whole = (hi - lo) * w[hi - 1]
            for cut in range(lo + 1, hi):
                if w[cut - 1] == w[cut]:
                    continue
                saving = whole - (cut - lo) * w[cut - 1] - (hi - cut) * w[hi - 1]
                if best is None or saving > best[0]:
                    best = (saving, gi, cut)
        if best is None or best[0] <= group_cost:
            break
        _, gi, cut = best
        lo, hi = spans[gi]
        spans[gi:gi + 1] = [(lo, cut), (cut, hi)]
    return [order[lo:hi] for lo, hi in spans]


def key_mask(seq_lens: torch.Tensor, length: int, rows: int) -> torch.Tensor:
    """True where a key position is past what a query row may see: [B, L] for one row per
    sequence, [B, Q, L] for Q verify rows (row j sees seq_len - (Q-1-j) keys)."""
    span = torch.arange(length, device=seq_lens.device)
    if rows == 1:
        return span[None, :] >= seq_lens[:, None]
    return span[None, None, :] >= verify_kv_lens(seq_lens, rows)[:, :, None]


def verify_kv_lens(seq_lens: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, rows] KV length each query row attends to: the run's rows are the sequence's
    last `rows` tokens, so row j sees seq_len - (rows-1-j). At least 1, so padding
    sequences (seq_len 1) never softmax over an empty row."""
    back = torch.arange(rows - 1, -1, -1, device=seq_lens.device, dtype=seq_lens.dtype)
    return (seq_lens[:, None] - back[None, :]).clamp_min_(1)


def build_plan(meta: AttentionMetadata, num_seqs: int, rows: int, block_size: int
               ) -> list[DecodeGroup]:
    """Groups for the first `num_seqs` (decode) sequences of `meta`."""
    tables, lens = meta.block_tables[:num_seqs], meta.seq_lens[:num_seqs]
    host = meta.seq_lens_host
    if meta.num_padding or len(host) < num_seqs:      # graph buffers: one group, as given
        w = tables.shape[1]
        return [DecodeGroup(None, tables.reshape(-1), num_seqs, w,
                            key_mask(lens, w * block_size, rows))]
    widths = [-(-n // block_size) for n in host[:num_seqs]]
    groups = split_by_width(widths) if num_seqs > 1 else [list(range(num_seqs))]
    device = tables.device
    plan = []
    for seqs in groups:
        w = max(widths[i] for i in seqs)
        if len(groups) == 1:
            q_rows, g_tables, g_lens = None, tables[:, :w], lens
        else:
            idx = torch.tensor(seqs, dtype=torch.long, device=device)
            g_tables, g_lens = tables.index_select(0, idx)[:, :w], lens.index_select(0, idx)
            q_rows = idx if rows == 1 else (
                idx[:, None] * rows + torch.arange(rows, device=device)).reshape(-1)
        plan.append(DecodeGroup(q_rows, g_tables.reshape(-1), len(seqs), w,
                                key_mask(g_lens, w * block_size, rows)))
    return plan
