"""SpeculativeWorker: holds the target Worker; `step` dispatches on empty / prefill / decode
(docs/ARCHITECTURE.md, 'The execution trunk', step 8). Subclasses (MTPWorker) supply the draft:
`propose` and the hooks that feed it the target's hidden states.

decode step:  propose (k draft tokens + their probabilities per sequence)
              -> verify: k+1 rows per sequence ([current, -1, -2, ...] with the
                 placeholders replaced by the drafts), one target forward through the
                 target's executor (executor.forward(fi) -> hidden states), logits and
                 sampler on all rows
              -> rejection sampling -> accepted run + final token per sequence
              -> `after_verify` hands the accepted rows' hidden states to the draft.
The scheduler then rolls back the rejected drafts' KV slots (postprocess.py).
"""

from __future__ import annotations

import torch

from engine.forward_input import ForwardInput
from engine.input_builder import BatchInputBuilder
from engine.logprobs import TokenLogprob, token_logprob
from engine.sampling_metadata import SamplingMetadata
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.speculative.metrics import SpecMetrics
from engine.speculative.postprocess import SeqStepResult, postprocess_speculative
from engine.speculative.rejection_sampler import rejection_sample
from engine.speculative.spec_input import RunLayout, build_runs, fill_placeholders, verify_runs
from engine.worker import Worker


class SpeculativeWorker:
    def __init__(self, target: Worker, builder: BatchInputBuilder, num_speculative_tokens: int,
                 block_size: int, vocab_size: int, max_model_len: int):
        self.target = target
        self.builder = builder
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.metrics = SpecMetrics(num_speculative_tokens)
        self.last_num_tokens = 0

    # ---- engine entry --------------------------------------------------------------
    def execute(self, sched: SchedulerOutput, scheduler: Scheduler,
                eos_token_ids: frozenset[int]) -> list[Sequence]:
        results = self.step(sched)
        tables = self.pending_tables(sched.seqs)
        grew, self.last_num_tokens = postprocess_speculative(scheduler, sched, results,
                                                             eos_token_ids)
        self.finish_drafts([s for s in sched.seqs if s.is_finished], tables)
        self.forget_finished({s.seq_id for s in scheduler.running})
        return grew

    @torch.inference_mode()
    def step(self, sched: SchedulerOutput) -> dict[int, SeqStepResult]:
        if sched.is_empty:
            return {}
        prefill, decodes = SchedulerOutput(), []
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            if n == 1 and seq.num_uncomputed_tokens == 1:
                decodes.append(seq)
            else:
                prefill.seqs.append(seq)
                prefill.num_new_tokens.append(n)
        results: dict[int, SeqStepResult] = {}
        if prefill.seqs:
            results.update(self.step_prefill(prefill))
        if decodes:
            results.update(self.step_decode(decodes))
        return results

    # ---- target forwards -----------------------------------------------------------
    def target_forward(self, fi: ForwardInput) -> tuple[ForwardInput, torch.Tensor]:
        """Through the target worker's prepare stage and executor: (device input, hidden)."""
        prepared = self.target.prepare_work_before_execute(fi)
        self.target.device.current_stream().wait_event(prepared.ready_event)
        return prepared.input, self.target.executor.forward(prepared.input)

    def step_prefill(self, sched: SchedulerOutput) -> dict[int, SeqStepResult]:
        fi = self.builder.build_forward_input(sched)
        dfi, hidden = self.target_forward(fi)
        results = {}
        if fi.sampling is not None and fi.selected_token_idxes.numel():
            logits = self.target.model.logits(hidden, dfi.selected_token_idxes)
            out = self.target.sampler(logits, dfi.sampling)
            tokens = out.next_tokens.tolist()
            by_id = {s.seq_id: s for s in sched.seqs}
            seqs = [by_id[i] for i in fi.selected_seq_ids]
            lps = logprob_entries(logits, tokens, seqs)
            for row, (seq, tok) in enumerate(zip(seqs, tokens, strict=True)):
                results[seq.seq_id] = SeqStepResult([tok], 0,
                                                    None if lps is None else [lps[row]])
        self.after_prefill(sched, fi, hidden)
        return results

    def step_decode(self, seqs: list[Sequence]) -> dict[int, SeqStepResult]:
        ks = [self.num_drafts_for(s) for s in seqs]
        drafts, draft_probs = self.propose(seqs, ks)
        runs = verify_runs(seqs, ks)
        fi, layout = build_runs(runs, self.block_size)
        fill_placeholders(fi, layout, drafts)
        fi.sampling = verify_sampling(seqs, drafts, layout.order, self.vocab_size)
        dfi, hidden = self.target_forward(fi)
        logits = self.target.model.logits(hidden, dfi.selected_token_idxes)
        out = self.target.sampler(logits, dfi.sampling, return_probs=True)
        kmax = max(ks)
        b = len(seqs)
        dev = logits.device
        # [B, kmax+1] row indices of each sequence's verify rows (padded with its last row)
        sel_start = _selected_starts(layout, ks)
        idx = torch.tensor([[sel_start[i] + min(j, ks[i]) for j in range(kmax + 1)]
                            for i in range(b)], dtype=torch.int64, device=dev)
        target_probs = out.probs[idx]
        target_tokens = out.next_tokens[idx]
        draft_tok = torch.tensor([d + [0] * (kmax - len(d)) for d in drafts],
                                 dtype=torch.int64, device=dev).reshape(b, kmax)
        if draft_probs is None:
            draft_probs = torch.zeros(b, kmax, logits.shape[-1], device=dev)
        greedy = torch.tensor([s.params.temperature == 0.0 for s in seqs], device=dev)
        gens = {i: s.generator for i, s in enumerate(seqs) if s.generator is not None}
        rej = rejection_sample(draft_tok, torch.tensor(ks, device=dev), draft_probs,
                               target_probs, target_tokens, greedy, gens)
        accepted = rej.num_accepted.tolist()
        emitted = rej.tokens.tolist()
        self.metrics.record(ks, accepted)
        self.after_verify(seqs, hidden, layout, accepted)
        lp_rows = [sel_start[i] + j for i in range(b) for j in range(accepted[i] + 1)]
        lp_seqs = [seqs[i] for i in range(b) for _ in range(accepted[i] + 1)]
        lp_tokens = [emitted[i][j] for i in range(b) for j in range(accepted[i] + 1)]
        lps = None
        if any(s.params.logprobs is not None for s in seqs):
            rows = torch.tensor(lp_rows, dtype=torch.int64, device=dev)
            lps = logprob_entries(logits.index_select(0, rows), lp_tokens, lp_seqs)
        results, pos = {}, 0
        for i, seq in enumerate(seqs):
            n = accepted[i] + 1
            results[seq.seq_id] = SeqStepResult(emitted[i][:n], accepted[i],
                                                None if lps is None else lps[pos:pos + n])
            pos += n
        return results

    def num_drafts_for(self, seq: Sequence) -> int:
        """k, less where the sequence would pass max_model_len or max_tokens."""
        room = min(self.max_model_len - len(seq), seq.params.max_tokens - seq.num_output_tokens)
        return max(0, min(self.k, room - 1))

    # ---- the draft (subclasses) ----------------------------------------------------
    def propose(self, seqs: list[Sequence], num_drafts: list[int]
                ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Per sequence num_drafts[i] draft tokens, and their draft probabilities
        [B, max(num_drafts), V] (selected rows only)."""
        raise NotImplementedError

    def after_prefill(self, sched: SchedulerOutput, fi: ForwardInput,
                      hidden: torch.Tensor) -> None:
        pass

    def after_verify(self, seqs: list[Sequence], hidden: torch.Tensor, layout: RunLayout,
                     accepted: list[int]) -> None:
        pass

    def pending_tables(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """Block tables (before postprocess frees them) of the sequences whose draft still
        has verified positions to run over."""
        return {}

    def finish_drafts(self, finished: list[Sequence], tables: dict[int, list[int]]) -> None:
        """Sequences that finished this step: complete the draft's state of their blocks."""

    def forget_finished(self, live_seq_ids: set[int]) -> None:
        pass

    def stats(self) -> dict:
        return self.metrics.stats()


def verify_sampling(seqs: list[Sequence], drafts: list[list[int]], order: list[int],
                    vocab_size: int) -> SamplingMetadata:
    """One sampling row per verify row: row j of a sequence sees the drafts before it as
    output tokens (so penalties match plain decoding had they been accepted)."""
    params, prompts, outputs, gens = [], [], [], []
    penal = any(s.params.has_penalties for s in seqs)
    for i in order:         # row order of the verify input
        seq, d = seqs[i], drafts[i]
        for j in range(len(d) + 1):
            params.append(seq.params)
            prompts.append(seq.prompt_token_ids if penal else [])
            outputs.append(seq.output_token_ids + d[:j] if penal else [])
            gens.append(seq.generator)
    return SamplingMetadata.build(params, prompts, outputs, gens, vocab_size)


def logprob_entries(logits: torch.Tensor, tokens: list[int], seqs: list[Sequence]
                    ) -> list[TokenLogprob] | None:
    """The emitted token's logprob and the top-k per row, under the raw logits."""
    wants = [s.params.logprobs for s in seqs]
    if all(k is None for k in wants):
        return None
    lp = torch.log_softmax(logits.float(), dim=-1)
    kmax = max(k or 0 for k in wants)
    top_lp, top_tok = lp.topk(kmax, dim=-1) if kmax else (None, None)
    own = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    out = []
    for row, (tok, k) in enumerate(zip(tokens, wants, strict=True)):
        out.append(token_logprob(tok, own[row], top_tok[row, :k].tolist() if k else (),
                                 top_lp[row, :k].tolist() if k else (), k or 0))
    return out


def _selected_starts(layout: RunLayout, ks: list[int]) -> list[int]:
    """Each run's first selected row among the selected rows (all rows are selected)."""
    starts, total = [0] * len(ks), 0
    for i in layout.order:
        starts[i] = total
        total += ks[i] + 1
    return starts
