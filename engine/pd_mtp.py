"""What the decode node's MTP draft needs from a PD push, so it drafts from the first
decode step exactly as it would after a local prefill.

After a local prefill, the MTP worker holds (engine/speculative/mtp_worker.py):
- the draft layer's K/V for prompt positions 0 .. n-2 (the draft ran over the prompt,
  each position with the token that follows it), in the draft cache, addressed through
  the sequence's block table;
- an EmbeddingCache entry: the target's hidden state at position n-1, waiting for the
  token the prefill samples.
`MtpHandoff` is exactly that, for the pushed blocks: the prefill node collects it from
its own MTP worker (`MtpCollector`), the push carries it in PushDone.mtp, and the decode
node installs it (`install_handoff`) into its draft cache and EmbeddingCache before the
sequence joins the running batch. Without a handoff (a prefill node without MTP), the
decode node's draft simply starts one step later (MTPWorker drafts nothing for a
sequence that has no EmbeddingCache entry); tokens are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_cache import gather_blocks, scatter_blocks
from engine.sequence import Sequence
from engine.speculative.embedding_cache import EmbeddingCache


@dataclass
class MtpHandoff:
    hidden: torch.Tensor      # [1, hidden_size], the target's hidden state at position n-1
    draft_k: torch.Tensor     # [len(pushed blocks), block_size, kv_heads, head_dim]
    draft_v: torch.Tensor


def mtp_worker_of(engine):
    """The engine's MTP worker (has a draft cache and an EmbeddingCache), or None."""
    spec = getattr(engine, "speculative", None)
    if spec is None or not hasattr(spec, "embedding_cache"):
        return None
    return spec


class _WatchedEmbeddingCache(EmbeddingCache):
    """EmbeddingCache that keeps, for watched sequences, the entry `retain` drops: a PD
    prefill sequence finishes (max_tokens=1) inside the step that writes its entry."""

    def __init__(self, base: EmbeddingCache):
        super().__init__()
        self._entries = base._entries
        self.watched: set[int] = set()
        self.kept: dict[int, torch.Tensor] = {}

    def retain(self, live_seq_ids: set[int]) -> None:
        for sid in self.watched:
            entry = self.get(sid)
            if entry is not None and sid not in live_seq_ids:
                self.kept[sid] = entry.hidden
        super().retain(live_seq_ids)


class MtpCollector:
    """Prefill side: collects the handoff of PD requests from the engine's MTP worker."""

    def __init__(self, engine):
        self.worker = mtp_worker_of(engine)
        if self.worker is not None:
            self.cache = _WatchedEmbeddingCache(self.worker.embedding_cache)
            self.worker.embedding_cache = self.cache

    @property
    def enabled(self) -> bool:
        return self.worker is not None

    def watch(self, seq_id: int) -> None:
        if self.enabled:
            self.cache.watched.add(seq_id)

    def take(self, seq: Sequence, src_block_ids: list[int]) -> MtpHandoff | None:
        """The handoff of `seq` whose prefill finished this step; src_block_ids: its
        pushed blocks on this node (read now: nothing has run since the draft wrote them,
        even if the finished sequence's blocks are already back in the pool)."""
        if not self.enabled:
            return None
        self.cache.watched.discard(seq.seq_id)
        hidden = self.cache.kept.pop(seq.seq_id, None)
        if hidden is None:
            entry = self.cache.get(seq.seq_id)
            hidden = None if entry is None else entry.hidden
        if hidden is None:
            return None
        kv = self.worker.draft_executor.kv_cache
        idx = torch.tensor(src_block_ids, dtype=torch.long, device=kv.k[0].device)
        return MtpHandoff(hidden.reshape(1, -1).to("cpu"),
                          gather_blocks(kv.k[0], idx).to("cpu"),
                          gather_blocks(kv.v[0], idx).to("cpu"))

    def forget(self, seq_id: int) -> None:
        if self.enabled:
            self.cache.watched.discard(seq_id)
            self.cache.kept.pop(seq_id, None)


def check_handoff(engine, handoff: MtpHandoff, num_push_blocks: int) -> str | None:
    """Why `handoff` does not fit this engine's draft (None: it fits)."""
    worker = mtp_worker_of(engine)
    if worker is None:
        return None         # no draft here: the handoff is ignored
    kv = worker.draft_executor.kv_cache
    want_kv = (num_push_blocks, *kv.block_shape)
    hidden_size = engine.model_config.hidden_size
    if tuple(handoff.hidden.shape) != (1, hidden_size):
        return f"MTP hidden state has shape {list(handoff.hidden.shape)}, " \
               f"expected [1, {hidden_size}]"
    for name, t in (("K", handoff.draft_k), ("V", handoff.draft_v)):
        if tuple(t.shape) != want_kv:
            return f"MTP draft {name} has shape {list(t.shape)}, expected {list(want_kv)}"
        if t.dtype != kv.k[0].dtype:
            return f"MTP draft {name} has dtype {t.dtype}, expected {kv.k[0].dtype}"
    if handoff.hidden.dtype != engine.dtype:
        return f"MTP hidden state has dtype {handoff.hidden.dtype}, expected {engine.dtype}"
    return None


def install_handoff(engine, seq: Sequence, handoff: MtpHandoff,
                    push_block_ids: list[int]) -> bool:
    """Decode side, under the engine lock, before `seq` runs: the draft KV into the
    pushed blocks and the last hidden state into the EmbeddingCache. False when this
    engine has no MTP draft (the handoff is not needed)."""
    worker = mtp_worker_of(engine)
    if worker is None:
        return False
    kv = worker.draft_executor.kv_cache
    dev = kv.k[0].device
    if push_block_ids:
        idx = torch.tensor(push_block_ids, dtype=torch.long, device=dev)
        scatter_blocks(kv.k[0], idx, handoff.draft_k.to(dev))
        scatter_blocks(kv.v[0], idx, handoff.draft_v.to(dev))
    worker.embedding_cache.put(seq.seq_id, seq.num_prompt_tokens - 1,
                               handoff.hidden.to(dev).clone())
    return True
