"""MTPWorker: the MTP draft (engine/models/mtp.py) on top of SpeculativeWorker.

Holds the draft module, its own one-layer KV cache and the EmbeddingCache.

- prefill: after the target's forward, the draft runs over the chunk's positions that
  already have a following token (its K/V and hidden states); the last prompt position
  waits in the EmbeddingCache for the token the target just sampled. What the cache (and
  a PD handoff) holds is the draft's input, `draft.draft_input` of the target's rows: the
  final hidden state, plus the projected mid-layer features for a head that reads them.
- draft loop (num_speculative_tokens steps):
    step 1 runs over the EmbeddingCache rows of each sequence (the target's hidden states
    of the tokens accepted last step, each with the token that followed it); its last
    row proposes d_1.
    step j > 1 feeds back d_{j-1} and the draft's own hidden state of step j-1: one row.
  Draft probabilities are kept for the selected rows only.
- after verify: the accepted rows' target hidden states go back into the EmbeddingCache
  (after the rows still pending when a step had no room to draft).
- a sequence that finishes: the draft runs over its pending rows (finish_drafts), so the
  blocks it leaves in the prefix cache hold the draft K/V of every position.

The draft cache has the target cache's geometry (num_blocks x block_size, one layer) and
is addressed through the target's block tables, so it is sized once, never allocates, and
needs no rollback of its own: a rejected draft's K/V slot is rewritten by the next step's
first draft step before anything reads it. It does no prefix-cache lookup of its own: the
draft always runs over what the target computed this step.
"""

from __future__ import annotations

import torch

from engine.forward_input import ForwardInput
from engine.kv_cache import KVCache
from engine.models.mtp import MTPModule
from engine.sampler import Sampler
from engine.sampling_metadata import SamplingMetadata
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative.embedding_cache import EmbeddingCache
from engine.speculative.spec_input import RowRun, RunLayout, build_runs
from engine.speculative.speculative_worker import SpeculativeWorker


class MTPExecutor:
    """The draft's executor: like the eager one, plus the previous hidden states."""

    def __init__(self, model: MTPModule, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache

    @torch.inference_mode()
    def forward(self, fi: ForwardInput, prev_hidden: torch.Tensor) -> torch.Tensor:
        return self.model(fi.token_ids, prev_hidden, fi.positions, self.kv_cache.k[0],
                          self.kv_cache.v[0], fi.attn)


class MTPWorker(SpeculativeWorker):
    def __init__(self, target, builder, draft: MTPModule, draft_kv_cache: KVCache,
                 num_speculative_tokens: int, block_size: int, vocab_size: int,
                 max_model_len: int):
        super().__init__(target, builder, num_speculative_tokens, block_size, vocab_size,
                         max_model_len)
        self.draft = draft
        self.draft_executor = MTPExecutor(draft, draft_kv_cache)
        self.draft_sampler = Sampler(cpu_argmax=target.sampler.cpu_argmax)
        self.embedding_cache = EmbeddingCache()
        # PD hand-off (engine/pd_mtp.py): sequences whose last hidden state outlives their
        # finish until the prefill node's push takes it
        self._handoff_watch: set[int] = set()
        self._handoff_kept: dict[int, torch.Tensor] = {}

    @property
    def draft_kv_cache(self) -> KVCache:
        return self.draft_executor.kv_cache

    # ---- the PD hand-off: what a decode node's draft needs after a remote prefill --------
    def keep_handoff(self, seq_id: int) -> None:
        """Keep this sequence's pending hidden state when it finishes (a PD prefill finishes
        in the step that writes it), until `take_handoff_hidden`."""
        self._handoff_watch.add(seq_id)

    def take_handoff_hidden(self, seq_id: int) -> torch.Tensor | None:
        """The hidden state at the prompt's last position, kept for the hand-off."""
        self._handoff_watch.discard(seq_id)
        hidden = self._handoff_kept.pop(seq_id, None)
        if hidden is None:
            entry = self.embedding_cache.get(seq_id)
            hidden = None if entry is None else entry.hidden
        return hidden

    def forget_handoff(self, seq_id: int) -> None:
        self._handoff_watch.discard(seq_id)
        self._handoff_kept.pop(seq_id, None)

    def install_hidden(self, seq_id: int, position: int, hidden: torch.Tensor) -> None:
        """Decode side: the pushed hidden state at `position`, as a local prefill leaves it."""
        self.embedding_cache.put(seq_id, position, hidden)

    def draft_forward(self, fi: ForwardInput, prev_hidden: torch.Tensor
                      ) -> tuple[ForwardInput, torch.Tensor]:
        prepared = self.target.prepare_work_before_execute(fi)
        self.target.device.current_stream().wait_event(prepared.ready_event)
        return prepared.input, self.draft_executor.forward(prepared.input, prev_hidden)

    # ---- prefill: the draft over the prompt --------------------------------------------
    def after_prefill(self, sched: SchedulerOutput, fi: ForwardInput,
                      hidden: torch.Tensor) -> None:
        runs, hs = [], []
        row = 0
        hidden = self.draft.draft_input(hidden)     # + the head's mid-layer features
        # prefill-only sub-batch: rows follow the scheduled order, no padding
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            start = seq.num_cached_tokens
            h = hidden[row:row + n]
            row += n
            self.embedding_cache.pop(seq.seq_id)       # (re)computing: nothing pending
            last_has_next = start + n < len(seq)       # a chunk inside the prompt
            m = n if last_has_next else n - 1
            if m > 0:
                runs.append(RowRun(seq, start, seq.token_ids[start + 1:start + m + 1], "none"))
                hs.append(h[:m])
            if not last_has_next:
                self.embedding_cache.put(seq.seq_id, start + n - 1, h[n - 1:n].clone())
        if runs:
            dfi, layout = build_runs(runs, self.block_size)
            self.draft_forward(dfi, _in_layout_order(hs, layout))

    # ---- the draft loop ------------------------------------------------------------
    def propose(self, seqs: list[Sequence], num_drafts: list[int]
                ) -> tuple[list[list[int]], torch.Tensor | None]:
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(num_drafts) if k > 0]
        if not active:
            return drafts, None
        kmax = max(num_drafts)
        probs_steps: list[torch.Tensor] = []
        prev_h, prev_active = None, active
        for j in range(kmax):
            active = [i for i in active if num_drafts[i] > j]
            if j == 0:
                runs, hs = [], []
                for i in active:
                    entry = self.embedding_cache.pop(seqs[i].seq_id)     # consumed
                    s = entry.start
                    runs.append(RowRun(seqs[i], s,
                                       seqs[i].token_ids[s + 1:s + 1 + entry.num_rows]))
                    hs.append(entry.hidden)
                fi, layout = build_runs(runs, self.block_size)
                h_in = _in_layout_order(hs, layout)
            else:
                pos = {i: n for n, i in enumerate(prev_active)}
                runs = [RowRun(seqs[i], len(seqs[i]) - 2 + j, [drafts[i][-1]])
                        for i in active]
                fi, layout = build_runs(runs, self.block_size)
                h_in = prev_h[torch.tensor([pos[active[r]] for r in layout.order],
                                           device=prev_h.device)]
            dfi, out_h = self.draft_forward(fi, h_in)
            logits = self.draft.logits(out_h, dfi.selected_token_idxes)
            meta = _draft_sampling([seqs[active[r]] for r in layout.order],
                                   [drafts[active[r]] for r in layout.order], self.vocab_size)
            sample = self.draft_sampler(logits, meta.to(logits.device), return_probs=True)
            tokens = sample.next_tokens.tolist()
            # back to `active` order
            back = {active[r]: n for n, r in enumerate(layout.order)}
            for i in active:
                drafts[i].append(tokens[back[i]])
            sel_h = out_h.index_select(0, dfi.selected_token_idxes)
            perm = torch.tensor([back[i] for i in active], device=out_h.device)
            prev_h = sel_h[perm]
            step_probs = torch.zeros(len(seqs), logits.shape[-1], device=logits.device)
            step_probs[torch.tensor(active, device=logits.device)] = sample.probs[perm]
            probs_steps.append(step_probs)
            prev_active = active
        return drafts, torch.stack(probs_steps, dim=1)

    # ---- after verify: accepted hidden states back into the cache ------------------------
    def after_verify(self, seqs: list[Sequence], hidden: torch.Tensor, layout: RunLayout,
                     accepted: list[int]) -> None:
        hidden = self.draft.draft_input(hidden)
        for i, seq in enumerate(seqs):
            s = layout.row_start[i]
            start, rows = len(seq) - 1, hidden[s:s + accepted[i] + 1]
            # rows this step did not draft from (no room for a draft) stay pending: the
            # next draft step (or finish_drafts) runs over them, so no position's draft
            # K/V is skipped
            old = self.embedding_cache.pop(seq.seq_id)
            if old is not None and old.start + old.num_rows == start:
                start, rows = old.start, torch.cat((old.hidden, rows))
            self.embedding_cache.put(seq.seq_id, start, rows.clone())

    # ---- finished sequences: the draft K/V of their last verified positions ------------
    def pending_tables(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        return {s.seq_id: list(s.block_table) for s in seqs if s.seq_id in self.embedding_cache}

    def finish_drafts(self, finished: list[Sequence], tables: dict[int, list[int]]) -> None:
        """Run the draft over a finished sequence's pending rows (each with the token that
        followed it), as its next step would have, so every block it leaves in the prefix
        cache holds the draft K/V of every position: a later request that hits the block
        drafts exactly as if it had computed the prefix itself. The blocks were freed a
        moment ago but nothing has been allocated since, so writing them is safe."""
        runs, hs = [], []
        for seq in finished:
            entry = self.embedding_cache.get(seq.seq_id)
            if entry is None or seq.seq_id not in tables:
                continue
            n = min(entry.num_rows, len(seq) - 1 - entry.start)   # rows with a next token
            if n <= 0:
                continue
            runs.append(RowRun(_WithTable(seq, tables[seq.seq_id]), entry.start,
                               seq.token_ids[entry.start + 1:entry.start + 1 + n], "none"))
            hs.append(entry.hidden[:n])
        if runs:
            dfi, layout = build_runs(runs, self.block_size)
            self.draft_forward(dfi, _in_layout_order(hs, layout))

    def forget_finished(self, live_seq_ids: set[int]) -> None:
        for sid in self._handoff_watch:
            entry = self.embedding_cache.get(sid)
            if entry is not None and sid not in live_seq_ids:
                self._handoff_kept[sid] = entry.hidden
        self.embedding_cache.retain(live_seq_ids)

    def num_drafts_for(self, seq: Sequence) -> int:
        if seq.seq_id not in self.embedding_cache:
            return 0        # nothing to draft from (e.g. KV received without hidden states)
        return super().num_drafts_for(seq)


class _WithTable:
    """A finished sequence seen with the block table it had before it was freed."""

    def __init__(self, seq: Sequence, block_table: list[int]):
        self.seq_id, self.block_table = seq.seq_id, block_table


def _in_layout_order(hs: list[torch.Tensor], layout: RunLayout) -> torch.Tensor:
    return torch.cat([hs[i] for i in layout.order], dim=0)


def _draft_sampling(seqs: list[Sequence], drafts: list[list[int]], vocab_size: int
                    ) -> SamplingMetadata:
    penal = any(s.params.has_penalties for s in seqs)
    return SamplingMetadata.build(
        [s.params for s in seqs],
        [s.prompt_token_ids if penal else [] for s in seqs],
        [s.output_token_ids + d if penal else [] for s, d in zip(seqs, drafts, strict=True)],
        [s.generator for s in seqs], vocab_size)


def build_mtp_worker(engine) -> MTPWorker:
    """Load the draft for `engine`'s target, size its cache like the target's, and set
    the scheduler's lookahead to num_speculative_tokens."""
    from engine.models.mtp import load_mtp
    cfg = engine.config
    mc = engine.model_config
    draft = load_mtp(cfg.model, engine.model, engine.dtype, engine.device.torch_device,
                     cfg.attention_backend, cfg.speculative_model)
    heads, k_dim, v_dim = mc.kv_layout        # the target's layout (MLA: latent rows)
    draft_cache = KVCache(1, engine.kv_cache.num_blocks, cfg.block_size, heads, k_dim,
                          engine.dtype, engine.device.torch_device, v_head_dim=v_dim,
                          prefault=cfg.prefault_memory, huge_pages=cfg.huge_pages)
    engine.scheduler.num_lookahead_tokens = cfg.num_speculative_tokens
    return MTPWorker(engine.worker, engine.builder, draft, draft_cache,
                     cfg.num_speculative_tokens, cfg.block_size, mc.vocab_size,
                     engine.max_model_len)
