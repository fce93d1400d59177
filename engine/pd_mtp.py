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


@dataclass
class MtpHandoff:
    hidden: torch.Tensor      # [1, hidden_size], the target's hidden state at position n-1
    draft_k: torch.Tensor     # [len(pushed blocks), block_size, kv_heads, head_dim]
    draft_v: torch.Tensor


def mtp_worker_of(engine):
    """The engine's MTP worker (it has the hand-off calls), or None."""
    spec = getattr(engine, "speculative", None)
    return spec if spec is not None and hasattr(spec, "keep_handoff") else None


class MtpCollector:
    """Prefill side: collects the handoff of PD requests through the MTP worker's hand-off
    calls (`keep_handoff`, `take_handoff_hidden`)."""

    def __init__(self, engine):
        self.worker = mtp_worker_of(engine)

    @property
    def enabled(self) -> bool:
        return self.worker is not None

    def watch(self, seq_id: int) -> None:
        if self.enabled:
            self.worker.keep_handoff(seq_id)

    def take(self, seq: Sequence, src_block_ids: list[int]) -> MtpHandoff | None:
        """The handoff of `seq` whose prefill finished this step; src_block_ids: its
        pushed blocks on this node (read now: nothing has run since the draft wrote them,
        even if the finished sequence's blocks are already back in the pool)."""
        if not self.enabled:
            return None
        hidden = self.worker.take_handoff_hidden(seq.seq_id)
        if hidden is None:
            return None
        kv = self.worker.draft_kv_cache
        idx = torch.tensor(src_block_ids, dtype=torch.long, device=kv.k[0].device)
        return MtpHandoff(hidden.reshape(1, -1).to("cpu"),
                          gather_blocks(kv.k[0], idx).to("cpu"),
                          gather_blocks(kv.v[0], idx).to("cpu"))

    def forget(self, seq_id: int) -> None:
        if self.enabled:
            self.worker.forget_handoff(seq_id)


def check_handoff(engine, handoff: MtpHandoff, num_push_blocks: int) -> str | None:
    """Why `handoff` does not fit this engine's draft (None: it fits)."""
    worker = mtp_worker_of(engine)
    if worker is None:
        return None         # no draft here: the handoff is ignored
    kv = worker.draft_kv_cache
    hidden_size = engine.model_config.hidden_size
    if tuple(handoff.hidden.shape) != (1, hidden_size):
        return f"MTP hidden state has shape {list(handoff.hidden.shape)}, " \
               f"expected [1, {hidden_size}]"
    for name, t, block in (("K", handoff.draft_k, kv.block_shape),
                           ("V", handoff.draft_v, kv.v_block_shape)):    # MLA: V is empty
        want_kv = (num_push_blocks, *block)
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
    kv = worker.draft_kv_cache
    dev = kv.k[0].device
    if push_block_ids:
        idx = torch.tensor(push_block_ids, dtype=torch.long, device=dev)
        scatter_blocks(kv.k[0], idx, handoff.draft_k.to(dev))
        scatter_blocks(kv.v[0], idx, handoff.draft_v.to(dev))
    worker.install_hidden(seq.seq_id, seq.num_prompt_tokens - 1, handoff.hidden.to(dev).clone())
    return True
