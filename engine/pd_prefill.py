"""Prefill side of PD PUSH: run a prompt's prefill and hand each layer's KV for the
request's blocks to a sink as soon as that layer is written, then the first sampled token.

The hand-off rides on forward hooks installed on the decoder layers for one step only (a
scoped context in `execute`), so the model code reads no globals and knows nothing of PD.
A chunked prefill pushes, per step, the prompt blocks that became complete in that step
(the last, partial block once the whole prompt is computed). Blocks the decode node's
prefix cache already holds (`num_skip_blocks`) are never pushed.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.engine_core import LLMEngine
from engine.kv_cache import gather_blocks
from engine.pd_mtp import MtpCollector, MtpHandoff
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence

log = logging.getLogger(__name__)


class KvSink(Protocol):
    """Receives one request's KV, on the engine thread. Must return quickly (enqueue)."""

    def on_layer(self, layer: int, dst_block_ids: list[int], k: torch.Tensor,
                 v: torch.Tensor, ready: object | None) -> None:
        """k, v: [len(dst_block_ids), block_size, kv_heads, head_dim] host tensors; when
        `ready` is not None it is a device event to synchronize before reading them."""

    def on_first_token(self, token_id: int, logprob: dict[int, float] | None,
                       mtp: MtpHandoff | None = None) -> None:
        """mtp: what the decode node's MTP draft needs (when this engine runs MTP)."""

    def on_error(self, exc: BaseException) -> None: ...


@dataclass
class PushJob:
    seq: Sequence
    dst_block_ids: list[int]     # decode-side ids for every prompt block
    next_block: int              # prompt-block index of the next block to push
    sink: KvSink
    num_skip_blocks: int = 0
    mtp_src_blocks: list[int] | None = None   # set in the step that completes the prompt


def first_token_params(params: SamplingParams) -> SamplingParams:
    """The request's sampling parameters, generating only the first token."""
    from dataclasses import fields as dc_fields

    from engine.sampling_params import _Fields
    values = {f.name: getattr(params, f.name) for f in dc_fields(_Fields)}
    values.update(max_tokens=1, ignore_eos=True, stop=[], stop_token_ids=[])
    return SamplingParams(**values)


class PdPrefillEngine(LLMEngine):
    """LLMEngine whose steps also push the KV of registered PD requests, layer by layer."""

    def __init__(self, config):
        super().__init__(config)
        self.push_jobs: dict[int, PushJob] = {}      # seq_id -> job
        self.mtp = MtpCollector(self)                # the MTP handoff, when MTP is on

    def add_push_request(self, request_id: str, prompt_token_ids: list[int],
                         params: SamplingParams, dst_block_ids: list[int],
                         num_skip_blocks: int, sink: KvSink) -> Sequence:
        need = self.block_manager.blocks_needed(len(prompt_token_ids))
        if len(dst_block_ids) != need:
            raise ValueError(f"request {request_id}: {len(dst_block_ids)} destination block "
                             f"ids for a {len(prompt_token_ids)}-token prompt, expected {need} "
                             f"(block_size {self.config.block_size})")
        if not 0 <= num_skip_blocks <= need:
            raise ValueError(f"request {request_id}: num_cached_blocks {num_skip_blocks} "
                             f"outside [0, {need}]")
        seq = self.add_request(request_id, prompt_token_ids, first_token_params(params))
        self.push_jobs[seq.seq_id] = PushJob(seq, list(dst_block_ids), num_skip_blocks, sink,
                                             num_skip_blocks)
        self.mtp.watch(seq.seq_id)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        job = self.push_jobs.get(seq.seq_id) if seq is not None else None
        super().abort(request_id)
        if job is not None:
            self._fail(job, RuntimeError(f"prefill of request {request_id} was aborted"))

    # ---- the step ------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> list[Sequence]:
        plan = self._plan(sched)
        if not plan:
            return super().execute(sched)
        try:
            with self._layer_hooks(plan):
                grew = super().execute(sched)
        except Exception as exc:
            for job, _, _ in plan:
                self._fail(job, exc)
            raise
        for seq in grew:
            job = self.push_jobs.pop(seq.seq_id, None)
            if job is None:
                continue
            entry = seq.logprobs[0] if seq.logprobs else None
            mtp = None
            if job.mtp_src_blocks is not None:
                mtp = self.mtp.take(seq, job.mtp_src_blocks)
            job.sink.on_first_token(seq.output_token_ids[0], entry, mtp)
            self.release(seq.request_id)
        return grew

    def _plan(self, sched: SchedulerOutput) -> list[tuple[PushJob, torch.Tensor, list[int]]]:
        """(job, source block ids on this node, destination ids) to push in this step."""
        bs = self.config.block_size
        plan = []
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            job = self.push_jobs.get(seq.seq_id)
            if job is None:
                continue
            end = seq.num_cached_tokens + n
            prompt_len = seq.num_prompt_tokens
            upto = -(-end // bs) if end >= prompt_len else end // bs
            if end >= prompt_len and self.mtp.enabled:   # this node's ids of the pushed
                # blocks, kept now: the draft KV is read after the step has finished the
                # sequence and freed its block table
                job.mtp_src_blocks = list(seq.block_table[job.num_skip_blocks:upto])
            if upto > job.next_block:
                src = seq.block_table[job.next_block:upto]
                dst = job.dst_block_ids[job.next_block:upto]
                job.next_block = upto
                plan.append((job, torch.tensor(src, dtype=torch.long,
                                               device=self.device.torch_device), dst))
        return plan

    @contextlib.contextmanager
    def _layer_hooks(self, plan):
        kv = self.kv_cache
        on_device = not self.device.is_cpu

        def make_hook(layer: int):
            def hook(module, args, output):
                for job, src, dst in plan:
                    k = gather_blocks(kv.k[layer], src)
                    v = gather_blocks(kv.v[layer], src)
                    ready = None
                    if on_device:   # async copy out; the sink waits on the event
                        k, v = k.to("cpu", non_blocking=True), v.to("cpu", non_blocking=True)
                        ready = self.device.new_event()
                        ready.record(self.device.current_stream())
                    job.sink.on_layer(layer, dst, k, v, ready)
            return hook

        handles = [layer.register_forward_hook(make_hook(i))
                   for i, layer in enumerate(self.model.layers)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def reap_finished_jobs(self) -> None:
        """Fail the jobs whose sequence ended without a token (aborted, or it could never
        fit in the KV pool), so their senders stop waiting."""
        for job in [j for j in self.push_jobs.values() if j.seq.is_finished]:
            self._fail(job, RuntimeError(f"prefill of request {job.seq.request_id} ended "
                                         f"without a token ({job.seq.finish_reason})"))
            self.release(job.seq.request_id)

    def _fail(self, job: PushJob, exc: BaseException) -> None:
        self.push_jobs.pop(job.seq.seq_id, None)
        self.mtp.forget(job.seq.seq_id)
        try:
            job.sink.on_error(exc)
        except Exception:  # noqa: BLE001 - a sink must not take the engine down
            log.exception("request %s: KV sink failed", job.seq.request_id)
