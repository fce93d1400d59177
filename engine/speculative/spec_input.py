"""ForwardInputs for the speculative stages: draft catch-up, draft steps and verify.

Each sequence contributes a run of rows (given tokens at consecutive positions), addressed
through its block table, so the result is an ordinary ForwardInput: single-row runs become
decode rows (batched attention), longer runs extend rows (attention over the cached
context plus the causal run). When every run has the same length Q > 1 (a verify where
all sequences draft k tokens: Q = k+1), all runs are decode-like rows instead, Q per
sequence (num_decode_tokens = B*Q): the batched decode attention handles the causal
offset, and the graph executor replays the batch under GraphKey(bucket*Q, Q). Rows keep
the builder's order (decodes first); `layout` says where each run landed.

The verify input is the placeholder form of docs/ARCHITECTURE.md, 'The execution trunk', step 8.2:
[current, -1, -2, ...] per sequence, the placeholders then replaced by the draft tokens
(`fill_placeholders`).
A sequence drafting fewer tokens than the batch's most (max_tokens or max_model_len near,
no hidden states to draft from) gets padding rows in front of its run, so every verify
batch is uniform: a padding row is token 0 at the run's first position, its K/V written to
the padding slot and its output never selected; being first, it does not shift the causal
offsets of the real rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from engine.block_manager import PADDING_BLOCK_ID
from engine.forward_input import AttentionMetadata, ForwardInput
from engine.input_builder import cumsum0
from engine.sequence import Sequence


@dataclass
class RowRun:
    seq: Sequence
    start: int               # position of the first row
    tokens: list[int]        # one per row
    select: str = "last"     # which rows get logits: "last" | "all" | "none"
    pad_front: int = 0       # padding rows before the run (uniform verify batches)

    @property
    def num_rows(self) -> int:
        return self.pad_front + len(self.tokens)


@dataclass
class RunLayout:
    order: list[int]         # run indices in row order
    row_start: list[int]     # per run (by original index): its first real row in the batch


def build_runs(runs: list[RowRun], block_size: int) -> tuple[ForwardInput, RunLayout]:
    uniform = _uniform_length(runs)
    if uniform == 0 and any(r.pad_front for r in runs):
        raise ValueError("padding rows are only for runs padded to one common length")
    singles = [i for i, r in enumerate(runs) if r.num_rows == 1]
    multis = [i for i, r in enumerate(runs) if r.num_rows > 1]
    order = singles + multis
    tokens, positions, slots, tables = [], [], [], []
    seq_lens, q_lens, ctx_lens, last_page = [], [], [], []
    selected, selected_ids = [], []
    row_start = [0] * len(runs)
    bs = block_size
    padding_slot = PADDING_BLOCK_ID * bs
    for i in order:
        r = runs[i]
        n, start = len(r.tokens), r.start
        end = start + n
        if r.pad_front:
            tokens.extend([0] * r.pad_front)
            positions.extend([start] * r.pad_front)
            slots.extend([padding_slot] * r.pad_front)
        row_start[i] = len(tokens)
        tokens.extend(r.tokens)
        positions.extend(range(start, end))
        table = r.seq.block_table
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        nb = -(-end // bs)
        tables.append(table[:nb])
        seq_lens.append(end)
        q_lens.append(r.pad_front + n)
        ctx_lens.append(start)
        last_page.append(end - (nb - 1) * bs)
        if r.select == "all":
            selected.extend(range(row_start[i], row_start[i] + n))
            selected_ids.extend([r.seq.seq_id] * n)
        elif r.select == "last":
            selected.append(row_start[i] + n - 1)
            selected_ids.append(r.seq.seq_id)
    i32 = torch.int32
    if uniform > 1:       # every run decode-like, Q rows each
        singles, multis = order, []
    width = max((len(t) for t in tables), default=0)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=i32),
        query_start_loc=torch.tensor(cumsum0(q_lens), dtype=i32),
        block_tables=torch.tensor([t + [PADDING_BLOCK_ID] * (width - len(t)) for t in tables],
                                  dtype=i32).reshape(len(tables), width),
        paged_kv_indptr=torch.tensor(cumsum0([len(t) for t in tables]), dtype=i32),
        paged_kv_indices=torch.tensor(list(chain.from_iterable(tables)), dtype=i32),
        paged_kv_last_page_len=torch.tensor(last_page, dtype=i32),
        num_decodes=len(singles), num_prefills=len(multis),
        num_decode_tokens=sum(runs[i].num_rows for i in singles),
        num_padding=0, query_lens_host=q_lens, context_lens_host=ctx_lens,
        seq_lens_host=seq_lens,
    )
    fi = ForwardInput(
        token_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        attn=attn,
        selected_token_idxes=torch.tensor(selected, dtype=torch.int64),
        sampling=None,
        selected_seq_ids=selected_ids,
    )
    return fi, RunLayout(order, row_start)


def verify_runs(seqs: list[Sequence], num_drafts: list[int]) -> list[RowRun]:
    """k+1 rows per sequence: the current token, then placeholders -1, -2, ...; padded in
    front to max(num_drafts)+1 rows."""
    kmax = max(num_drafts, default=0)
    return [RowRun(s, len(s) - 1, [s.last_token] + [-(j + 1) for j in range(k)], "all",
                   pad_front=kmax - k)
            for s, k in zip(seqs, num_drafts, strict=True)]


def fill_placeholders(fi: ForwardInput, layout: RunLayout, draft_tokens: list[list[int]]
                      ) -> None:
    """Overwrite each run's placeholders with its draft tokens (in place, host tensor)."""
    for i, drafts in enumerate(draft_tokens):
        if drafts:
            s = layout.row_start[i] + 1
            fi.token_ids[s:s + len(drafts)] = torch.tensor(drafts, dtype=torch.int64)
    if bool((fi.token_ids < 0).any()):
        raise RuntimeError("verify input still holds placeholders after filling the drafts")


def _uniform_length(runs: list[RowRun]) -> int:
    """The common row count of all runs, 0 when they differ (or there are none)."""
    lengths = {r.num_rows for r in runs}
    return lengths.pop() if len(lengths) == 1 else 0

