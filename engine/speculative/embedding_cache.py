"""EmbeddingCache: per sequence, the target hidden states the draft has not consumed yet.

After a target forward over positions [start, start + n) of a sequence, the draft still has
to run over those positions (each with the token that follows it) before it can propose.
The cache keeps them as one entry (start, hidden[n, H]):

- after a prefill: the last prompt position only (the draft ran over the rest of the prompt
  in the same step; the last position needed the token just sampled);
- after a verify that accepted `a` drafts: positions [p, p + a], the current token's and
  the accepted drafts' hidden states (a + 1 rows); the next step's first draft step runs
  over exactly these rows, with the tokens that followed them (the accepted drafts and the
  bonus token), which also overwrites whatever the rejected drafts left in the draft KV;
- a step that did not draft (no room left) leaves its entry pending and after_verify
  appends the new rows to it, and a sequence that finishes has the draft run over its
  pending rows (MTPWorker.finish_drafts): no verified position's draft K/V is skipped,
  also in blocks the prefix cache hands to later requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CachedHidden:
    start: int                 # position of the first row
    hidden: torch.Tensor       # [n, H] on the device

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]


class EmbeddingCache:
    def __init__(self):
        self._entries: dict[int, CachedHidden] = {}

    def put(self, seq_id: int, start: int, hidden: torch.Tensor) -> None:
        self._entries[seq_id] = CachedHidden(start, hidden)

    def get(self, seq_id: int) -> CachedHidden | None:
        return self._entries.get(seq_id)

    def pop(self, seq_id: int) -> CachedHidden | None:
        return self._entries.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def retain(self, live_seq_ids: set[int]) -> None:
        """Drop entries of sequences that finished or were aborted."""
        for sid in [s for s in self._entries if s not in live_seq_ids]:
            del self._entries[sid]
