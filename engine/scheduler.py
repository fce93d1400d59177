"""Continuous batching with chunked prefill under a token budget, and preemption by
recompute when the block pool runs dry (never a crash).

Each step: running sequences first (decodes and unfinished prefill chunks, oldest first),
growing their block tables; when a sequence cannot grow, the newest running sequence is
preempted (its blocks freed, its tokens kept, re-queued at the front to be recomputed).
Then waiting sequences are admitted while the token budget, `max_num_seqs` and the pool
allow. Prefill and decode sequences share one batch.

A PD decode node's pushed prompts are a state of their own, WAITING_FOR_KV
(`reserve_for_kv`): the sequence owns its blocks (prefix hits reused, as a local prefill
would) while a prefill node writes their KV, counts against `max_num_seqs`, and is never
scheduled; `admit_with_kv` moves it into the running batch with its first token, and
`finish` gives its blocks back like any other sequence's. When nothing can be scheduled
because waiting requests need blocks that such sequences hold, the scheduler says so
(`stalled_on_kv`): only a push landing or a release can change it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.commands import CapacityError
from engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's work: the sequences and how many new tokens each computes."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 and s.num_uncomputed_tokens == 1
                   for s, n in zip(self.seqs, self.num_new_tokens, strict=True))


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.awaiting_kv: dict[int, Sequence] = {}     # seq_id -> WAITING_FOR_KV sequence
        # the last schedule() found nothing to run while sequences awaiting their KV hold
        # blocks the waiting ones need
        self.stalled_on_kv = False
        self.num_preemptions = 0
        # Speculative decoding: decode sequences also get blocks for this many draft tokens
        # (the verify step writes their K/V); rejected ones are rolled back after the step.
        self.num_lookahead_tokens = 0

    # ---- requests ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        need = self.bm.blocks_needed(len(seq))
        if need > self.bm.num_blocks - 1:
            raise ValueError(
                f"prompt of {len(seq)} tokens needs {need} KV blocks but the cache has "
                f"{self.bm.num_blocks - 1}; raise num_gpu_blocks or shorten the prompt")
        self.waiting.append(seq)

    # ---- PD decode side: sequences whose prompt KV a prefill node pushes --------------
    def reserve_for_kv(self, seq: Sequence) -> None:
        """Allocate `seq`'s prompt blocks (prefix hits reused) and hold it WAITING_FOR_KV.
        CapacityError when max_num_seqs or the pool is full."""
        busy = len(self.running) + len(self.waiting) + len(self.awaiting_kv)
        if busy >= self.max_num_seqs:
            raise CapacityError(f"decode node is full: {len(self.running) + len(self.waiting)} "
                                f"running/waiting and {len(self.awaiting_kv)} awaiting their "
                                f"KV of max_num_seqs {self.max_num_seqs}")
        if not self.bm.allocate(seq):
            raise CapacityError(f"decode node has {self.bm.num_free_blocks} free KV blocks, "
                                f"request {seq.request_id} needs "
                                f"{self.bm.blocks_needed(len(seq))}")
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.awaiting_kv[seq.seq_id] = seq

    def admit_with_kv(self, seq: Sequence, first_token: int,
                      eos_token_ids: frozenset[int]) -> None:
        """Every block's KV arrived: `seq` joins the running batch with the first token the
        prefill node sampled; its stop conditions apply at once."""
        if self.awaiting_kv.pop(seq.seq_id, None) is None:
            raise ValueError(f"request {seq.request_id} is not awaiting its KV")
        seq.num_cached_tokens = len(seq)
        self.bm.cache_full_blocks(seq)
        seq.append_token(first_token)
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled is None:
            seq.first_scheduled = time.monotonic()
        self.running.append(seq)
        self.stalled_on_kv = False          # something runs again
        self.check_stop(seq, eos_token_ids)

    def has_unfinished(self) -> bool:
        """Sequences to compute (those awaiting their KV have nothing to compute yet)."""
        return bool(self.waiting or self.running)

    def finish_unschedulable(self) -> list[Sequence]:
        """After a schedule() that found nothing to run: a waiting head larger than the
        whole pool can never run and is finished ("length"); one that fits waits for the
        blocks of sequences awaiting their KV (`stalled_on_kv`), which come back when their
        push lands or their reservation is released. Returns what it finished."""
        if not self.waiting or self.running:
            return []
        seq = self.waiting[0]
        if self.bm.blocks_needed(len(seq) + 1) <= self.bm.num_blocks - 1:  # 0 is padding
            self.stalled_on_kv = bool(self.awaiting_kv)
            return []
        self.finish(seq, "length")
        return [seq]

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """End a sequence (stop condition or abort) and release its blocks."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.awaiting_kv.pop(seq.seq_id, None) is not None:
            self.stalled_on_kv = False      # its blocks are back: the waiting may fit now
        self.bm.free(seq)

    # ---- scheduling ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.stalled_on_kv = False
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n < seq.num_uncomputed_tokens and not self.enable_chunked_prefill:
                i += 1
                continue
            target = seq.num_cached_tokens + n
            if n == 1 and seq.num_uncomputed_tokens == 1:
                target += self.num_lookahead_tokens
            while not self.bm.can_cover(seq, target):
                victim = self.running[-1]
                if victim.seq_id in scheduled:   # never undo work already in this batch
                    victim = seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue          # seq itself was preempted; running[i] is the next one
            self.bm.cover(seq, target)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            scheduled.add(seq.seq_id)
            budget -= n
            i += 1

        # Admit new work only when nothing had to be preempted (the pool is not tight).
        while (self.waiting and not out.preempted and budget > 0
               and len(self.running) + len(self.awaiting_kv) < self.max_num_seqs):
            seq = self.waiting[0]
            if not self.enable_chunked_prefill and len(seq) > budget:
                break
            if not self.bm.allocate(seq):
                break
            n = min(seq.num_uncomputed_tokens, budget)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    # ---- results -------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: dict[int, int],
                    eos_token_ids: frozenset[int]) -> list[Sequence]:
        """Advance the computed sequences; append each sampled token and apply the
        token-level stop conditions. Returns the sequences that gained a token."""
        grew = []
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            seq.num_cached_tokens += n
            self.bm.cache_full_blocks(seq)
            token = sampled.get(seq.seq_id)
            if token is None:       # a prefill chunk that did not reach the last token
                continue
            seq.append_token(token)
            grew.append(seq)
            self.check_stop(seq, eos_token_ids)
        return grew

    def check_stop(self, seq: Sequence, eos_token_ids: frozenset[int]) -> None:
        stop = token_stop(seq.last_token, seq.params, eos_token_ids, seq.num_output_tokens,
                          len(seq), self.max_model_len)
        if stop is not None:
            self.finish(seq, *stop)


def token_stop(token: int, params, eos_token_ids: frozenset[int], num_output_tokens: int,
               seq_len: int, max_model_len: int) -> tuple[str, int | None] | None:
    """(finish reason, stop reason) when a sequence whose last token is `token` (its
    `num_output_tokens`-th, `seq_len` tokens in all) ends on it, else None. Stop strings
    are text, applied apart (the output processor, the router)."""
    if not params.ignore_eos and token in eos_token_ids:
        return "stop", None
    if token in params.stop_token_ids:
        return "stop", token
    if num_output_tokens >= params.max_tokens or seq_len >= max_model_len:
        return "length", None
    return None
