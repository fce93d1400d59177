"""Prefill side of PD PUSH: run a prompt's prefill and hand each layer's KV for the
request's blocks to a sink as soon as that layer is written, then the first sampled token.

The hand-off is a connector composed into the engine (`LLMEngine(config,
KvPushConnector)`), not a subclass: it rides on forward hooks installed on the decoder
layers for one step only (the engine wraps the step in `step_scope`), so the model code
reads no globals and knows nothing of PD.
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

from engine.commands import AddRequest
from engine.logprobs import TokenLogprob
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

    def on_step_end(self) -> None:
        """Every layer of this step has been handed over (after the forward, before the
        step's token): a sink that sends a step's layers together sends them now."""

    def on_first_token(self, token_id: int, logprob: TokenLogprob | None,
                       mtp: MtpHandoff | None = None) -> None:
        """mtp: what the decode node's MTP draft needs (when this engine runs MTP)."""

    def on_error(self, exc: BaseException) -> None: ...


@dataclass(frozen=True)
class PushTarget:
    """Where a PD prefill's KV goes: the decode node's block ids for every prompt block,
    how many of them its prefix cache already holds, and the sink that sends them."""
    dst_block_ids: tuple[int, ...]
    num_skip_blocks: int
    sink: KvSink


@dataclass
class PushJob:
    seq: Sequence
    target: PushTarget
    next_block: int              # prompt-block index of the next block to push
    mtp_src_blocks: list[int] | None = None   # set in the step that completes the prompt


def first_token_params(params: SamplingParams) -> SamplingParams:
    """The request's sampling parameters, generating only the first token."""
    from dataclasses import fields as dc_fields

    from engine.sampling_params import _Fields
    values = {f.name: getattr(params, f.name) for f in dc_fields(_Fields)}
    values.update(max_tokens=1, ignore_eos=True, stop=[], stop_token_ids=[])
    return SamplingParams(**values)


def push_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 dst_block_ids: list[int], num_skip_blocks: int, sink: KvSink,
                 block_size: int) -> AddRequest:
    """The engine command for a PD prefill (ValueError naming what does not fit)."""
    need = -(-len(prompt_token_ids) // block_size)
    if len(dst_block_ids) != need:
        raise ValueError(f"request {request_id}: {len(dst_block_ids)} destination block "
                         f"ids for a {len(prompt_token_ids)}-token prompt, expected {need} "
                         f"(block_size {block_size})")
    if not 0 <= num_skip_blocks <= need:
        raise ValueError(f"request {request_id}: num_cached_blocks {num_skip_blocks} "
                         f"outside [0, {need}]")
    return AddRequest(request_id, list(prompt_token_ids), first_token_params(params),
                      push=PushTarget(tuple(dst_block_ids), num_skip_blocks, sink))


class KvPushConnector:
    """Composed into a prefill node's LLMEngine (`LLMEngine(config, KvPushConnector)`):
    the engine calls `watch` for a request added with a PushTarget, wraps each step in
    `step_scope` and reports its result to `step_done`; `reap` runs after every step."""

    def __init__(self, engine):
        self.engine = engine
        self.jobs: dict[int, PushJob] = {}      # seq_id -> job
        self.mtp = MtpCollector(engine)          # the MTP handoff, when MTP is on

    def watch(self, seq: Sequence, target: PushTarget) -> None:
        self.jobs[seq.seq_id] = PushJob(seq, target, target.num_skip_blocks)
        self.mtp.watch(seq.seq_id)

    @contextlib.contextmanager
    def step_scope(self, sched: SchedulerOutput):
        plan = self._plan(sched)
        if not plan:
            yield
            return
        try:
            delivered: set[int] = set()
            if self.engine.kv_cache.collective_reads:   # tensor parallel: after the forward
                yield
            else:
                with self._layer_hooks(plan, delivered):
                    yield
            # A forward that bypasses the layers' modules fired no hook for them: the
            # one-call C++ decode layers (any step whose rows are all single tokens: a
            # one-token prompt, or a prompt whose cached prefix leaves one token) or a
            # graph replay. The step has written every layer's KV by now and nothing has
            # run since, so the layers not yet handed over go from the cache, in order.
            for layer in range(len(self.engine.model.layers)):
                if layer not in delivered:
                    self._hand_over(layer, plan)
            for job in {id(job): job for job, _, _ in plan}.values():
                job.target.sink.on_step_end()
        except Exception as exc:
            for job, _, _ in plan:
                self._fail(job, exc)
            raise

    def step_done(self, grew: list[Sequence]) -> None:
        for seq in grew:
            job = self.jobs.pop(seq.seq_id, None)
            if job is None:
                continue
            entry = seq.logprobs[0] if seq.logprobs else None
            mtp = None
            if job.mtp_src_blocks is not None:
                mtp = self.mtp.take(seq, job.mtp_src_blocks)
            job.target.sink.on_first_token(seq.output_token_ids[0], entry, mtp)

    def reap(self) -> None:
        """Fail the jobs whose sequence ended without a token (aborted, or it could never
        fit in the KV pool), so their senders stop waiting."""
        for job in [j for j in self.jobs.values() if j.seq.is_finished]:
            self._fail(job, RuntimeError(f"prefill of request {job.seq.request_id} ended "
                                         f"without a token ({job.seq.finish_reason})"))

    def _plan(self, sched: SchedulerOutput) -> list[tuple[PushJob, torch.Tensor, list[int]]]:
        """(job, source block ids on this node, destination ids) to push in this step."""
        bs = self.engine.config.block_size
        plan = []
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            job = self.jobs.get(seq.seq_id)
            if job is None:
                continue
            end = seq.num_cached_tokens + n
            prompt_len = seq.num_prompt_tokens
            upto = -(-end // bs) if end >= prompt_len else end // bs
            if end >= prompt_len and self.mtp.enabled:   # this node's ids of the pushed
                # blocks, kept now: the draft KV is read after the step has finished the
                # sequence and freed its block table
                job.mtp_src_blocks = list(seq.block_table[job.target.num_skip_blocks:upto])
            if upto > job.next_block:
                src = seq.block_table[job.next_block:upto]
                dst = list(job.target.dst_block_ids[job.next_block:upto])
                job.next_block = upto
                plan.append((job, torch.tensor(src, dtype=torch.long,
                                               device=self.engine.device.torch_device), dst))
        return plan

    @contextlib.contextmanager
    def _layer_hooks(self, plan, delivered: set[int]):
        def make_hook(layer: int):
            def hook(module, args, output):
                self._hand_over(layer, plan)
                delivered.add(layer)
            return hook

        handles = [layer.register_forward_hook(make_hook(i))
                   for i, layer in enumerate(self.engine.model.layers)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hand_over(self, layer: int, plan) -> None:
        """Give the sinks this step's blocks of one layer, read from the KV cache: one
        gather for all the step's pushes (a 2,048-token step of 8 prompts made 480 small
        copies, a fifth of a prefill step on 2 CPU cores), each sink a slice of it."""
        eng = self.engine
        kv = eng.kv_cache
        srcs = [src for _, src, _ in plan]
        every = srcs[0] if len(srcs) == 1 else torch.cat(srcs)
        k_all, v_all = kv.gather(layer, every)
        start = 0
        for job, src, dst in plan:
            n = src.shape[0]
            k, v = k_all[start:start + n], v_all[start:start + n]
            start += n
            ready = None
            if not eng.device.is_cpu:   # async copy out; the sink waits on the event
                k, v = k.to("cpu", non_blocking=True), v.to("cpu", non_blocking=True)
                ready = eng.device.new_event()
                ready.record(eng.device.current_stream())
            job.target.sink.on_layer(layer, dst, k, v, ready)

    def _fail(self, job: PushJob, exc: BaseException) -> None:
        self.jobs.pop(job.seq.seq_id, None)
        self.mtp.forget(job.seq.seq_id)
        try:
            job.target.sink.on_error(exc)
        except Exception:  # noqa: BLE001 - a sink must not take the engine down
            log.exception("request %s: KV sink failed", job.seq.request_id)
