"""LLMEngine: owns the model, KV cache, scheduler, builder and worker; one `step()` runs
schedule -> build_forward_input -> Worker.step -> postprocess (docs/ARCHITECTURE.md, "The
execution trunk").

Its boundary is small (engine/commands.py): other threads submit typed commands (add,
abort, finish, reserve / free / admit a PD-prefilled sequence), which `run_once` applies
between steps, and everything a request gains leaves as an `EngineOutput` from
`run_once` (token ids, text with stop strings applied by engine/output_processor.py,
logprobs, finish, usage). `load()` is a snapshot any thread may read. A PD prefill
node composes a connector (engine/pd_prefill.py) that pushes KV from inside the step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import replace

import torch

from engine.block_manager import BlockManager
from engine.commands import (
    AbortRequest,
    AddRequest,
    AdmitPrefilled,
    Command,
    CommandInbox,
    EngineLoad,
    EngineOutput,
    FinishRequest,
    ReleaseRequest,
    ReserveForKv,
)
from engine.config import EngineConfig
from engine.device import Device
from engine.dtype import resolve_dtype
from engine.executor.graph_buckets import GraphOptions
from engine.executor.graph_stats import executor_stats
from engine.host_allocator import touch_heap
from engine.input_builder import BatchInputBuilder
from engine.kv_cache import KVCache
from engine.layers import attention_choice
from engine.layers.kernel_options import KernelOptions
from engine.logprobs import token_logprob
from engine.memory_sizing import num_kv_blocks, step_heap_bytes
from engine.models import mla_choice
from engine.models.loader import load_model
from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import build_speculative_worker, prepare_target
from engine.tokenizer import load_tokenizer
from engine.worker import Worker

log = logging.getLogger(__name__)

LOAD_HASHES_EVERY_S = 0.5      # the published prefix hashes need not be fresher
MAX_PUBLISHED_HASHES = 4096


class LLMEngine:
    def __init__(self, config: EngineConfig, connector=None):
        """connector: a factory `connector(engine)` for an object that takes part in each
        step (engine/pd_prefill.py's KvPushConnector), or None."""
        self.config = config
        self.device = Device(config.device, config.cpu_threads)
        from engine.models.model_config import ModelConfig
        mcfg = ModelConfig.from_folder(config.model)
        self.dtype = resolve_dtype(config.dtype, mcfg.torch_dtype, self.device)
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        kernels = replace(KernelOptions.from_env(), batch_invariant=config.batch_invariant)
        self.ranks = None       # tensor parallel: the group and the other ranks
        if config.tensor_parallel_size > 1:
            from engine.parallel.rank_worker import Ranks
            self.ranks, self.model, self.model_config = Ranks.start(
                config, mcfg, self.dtype, self.device.torch_device)
        else:
            self.model, self.model_config = load_model(config.model, self.dtype,
                                                       self.device.torch_device,
                                                       config.attention_backend, kernels,
                                                       huge_pages=config.huge_pages)
        log.info("loaded %s (%s) in %.1fs", config.model, self.dtype, time.perf_counter() - t0)
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        bs = config.block_size
        num_blocks = config.num_gpu_blocks or num_kv_blocks(config, mc, self.dtype,
                                                            self.max_model_len)
        if self.ranks is not None:      # this rank's KV heads; the others make theirs
            self.kv_cache = self.ranks.make_cache(mc, num_blocks, bs)
        else:
            heads, k_dim, v_dim = mc.kv_layout
            self.kv_cache = KVCache(mc.num_hidden_layers, num_blocks, bs, heads, k_dim,
                                    self.dtype, self.device.torch_device, v_head_dim=v_dim,
                                    prefault=config.prefault_memory,
                                    huge_pages=config.huge_pages)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   config.enable_chunked_prefill)
        self.builder = BatchInputBuilder(bs, mc.vocab_size, config.min_decoding_batch_size)
        graph = (GraphOptions.from_engine_config(config, self.max_model_len)
                 if config.enable_graph else None)
        prepare_target(config, self.model)      # before the Worker sizes graph buffers
        self.worker = Worker(self.model, self.kv_cache, self.device, graph,
                             before_forward=self.ranks.send_step if self.ranks else None)
        self.speculative = None     # SpeculativeWorker when speculative_method is set
        if config.speculative_method is not None:
            self.speculative = build_speculative_worker(self)
        if self.device.torch_device.type == "cpu":     # the block size is known from here
            for m in (self.model, getattr(self.speculative, "draft", None)):
                if m is not None:
                    attention_choice.choose_for(m, bs, self.dtype, self.device.torch_device)
                    mla_choice.choose_decode(m, bs, self.dtype, self.device.torch_device)
        self.requests: dict[str, Sequence] = {}
        self.counters = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0,
                         "computed_tokens": 0, "requests_finished": 0}
        self.tokenizer = load_tokenizer(config.model)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None \
                and not self.eos_token_ids:
            self.eos_token_ids = frozenset([self.tokenizer.eos_token_id])
        self.output_processor = OutputProcessor(self.tokenizer)
        self.inbox = CommandInbox()
        self._changed: dict[int, Sequence] = {}   # gained or ended outside a step
        self._load = EngineLoad()
        self._load_hashes_at = 0.0
        self.connector = connector(self) if connector is not None else None
        self._refresh_load()
        self.host_reserve_bytes = 0     # the heap a step works in, touched at start
        if config.prefault_memory and self.device.torch_device.type == "cpu":
            self.host_reserve_bytes = step_heap_bytes(config, mc, self.dtype)
            self.refill_host_reserve()

    def refill_host_reserve(self) -> None:
        """Map the step's working heap again (host_allocator.touch_heap): at start, and by
        the engine loop after the heap trimmer gave its pages back while idle."""
        touch_heap(self.host_reserve_bytes)

    def close(self) -> None:
        """Stop what this engine started outside its process (tensor parallel's other
        ranks); also done when the engine is collected or the process exits."""
        if self.ranks is not None:
            self.ranks.close()

    # ---- requests ------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len}: the prompt plus at least one generated token must fit")
        bad = [t for t in prompt_token_ids
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        seq = Sequence(prompt_token_ids, params, request_id, arrival=time.monotonic())
        self.scheduler.add(seq)
        self.requests[request_id] = seq
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        return seq

    def abort(self, request_id: str) -> None:
        self.finish(request_id, "abort")

    def finish(self, request_id: str, reason: str, stop_reason=None) -> None:
        """End a live request now; its last output says `reason`."""
        seq = self.requests.get(request_id)
        # a sequence awaiting its KV is ended only by its reservation's owner (release):
        # a push may still be writing into its blocks
        if seq is not None and not seq.is_finished \
                and seq.status is not SequenceStatus.WAITING_FOR_KV:
            self.scheduler.finish(seq, reason, stop_reason)
            self._changed[seq.seq_id] = seq

    def release(self, request_id: str) -> None:
        """Forget a request at once, without a final output (its blocks are freed)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self._changed.pop(seq.seq_id, None)
            self.output_processor.forget(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """False while every waiting request waits for blocks that sequences awaiting their
        KV hold (Scheduler.stalled_on_kv): only a command (a push landing, a release) can
        change that."""
        sch = self.scheduler
        return (sch.has_unfinished() and not sch.stalled_on_kv) or bool(self._changed) \
            or bool(len(self.inbox))

    # ---- the command boundary ------------------------------------------------------
    def submit(self, command: Command) -> Future:
        """Thread-safe once a loop attached to the inbox (applied before its next step);
        before that, applied right here."""
        if self.inbox.attached:
            return self.inbox.put(command)
        fut: Future = Future()
        self._apply_one(command, fut)
        return fut

    def apply_commands(self) -> None:
        for command, fut in self.inbox.take():
            self._apply_one(command, fut)

    def _apply_one(self, command: Command, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = self._apply(command)
        except Exception as exc:  # noqa: BLE001 - the submitter gets it
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _apply(self, cmd: Command):
        if isinstance(cmd, AddRequest):
            seq = self.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params)
            if cmd.push is not None:
                self.connector.watch(seq, cmd.push)
            return seq
        if isinstance(cmd, AbortRequest):
            return self.finish(cmd.request_id, "abort")
        if isinstance(cmd, FinishRequest):
            return self.finish(cmd.request_id, cmd.reason, cmd.stop_reason)
        if isinstance(cmd, ReserveForKv):
            return self._reserve(cmd)
        if isinstance(cmd, ReleaseRequest):
            return self.release(cmd.request_id)
        if isinstance(cmd, AdmitPrefilled):
            return self._admit(cmd)
        raise TypeError(f"unknown engine command {type(cmd).__name__}")

    def run_once(self) -> list[EngineOutput]:
        """The loop body: apply the commands that arrived, run one step when there is
        work, and return every request's output since the last call."""
        self.apply_commands()
        grew = self.step() if self.scheduler.has_unfinished() else []
        outputs = self.take_outputs(grew)
        self._refresh_load()
        return outputs

    def settle(self) -> list[EngineOutput]:
        """Apply the commands that arrived, without a step (a loop calls it before each step)."""
        if not len(self.inbox) and not self._changed:      # nothing arrived: nothing to do
            return []
        self.apply_commands()
        outputs = self.take_outputs([])
        self._refresh_load()
        return outputs

    def take_outputs(self, grew: list[Sequence]) -> list[EngineOutput]:
        seqs = {s.seq_id: s for s in grew}
        seqs.update(self._changed)
        self._changed.clear()
        if self.connector is not None:
            self.connector.reap()
        outputs = []
        for seq in seqs.values():
            self._apply_stop_strings(seq)
            out = self.output_processor.delta(seq)
            if out is not None:
                outputs.append(out)
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
        return outputs

    def _apply_stop_strings(self, seq: Sequence) -> None:
        stop = self.output_processor.update(seq)
        if stop is not None and not seq.is_finished:
            self.scheduler.finish(seq, "stop", stop)

    def abort_all(self) -> list[EngineOutput]:
        """After a failed step: end every request (their outputs say "abort")."""
        for request_id in list(self.requests):
            self.finish(request_id, "abort")
        outputs = self.take_outputs([])
        self._refresh_load()
        return outputs

    def load(self) -> EngineLoad:
        return self._load

    def _refresh_load(self) -> None:
        bm, now = self.block_manager, time.monotonic()
        hashes = self._load.block_hashes
        if now - self._load_hashes_at >= LOAD_HASHES_EVERY_S:
            hashes = tuple(bm.cached_block_hashes()[:MAX_PUBLISHED_HASHES])
            self._load_hashes_at = now
        self._load = EngineLoad(len(self.scheduler.running), len(self.scheduler.waiting),
                                bm.num_free_blocks, bm.num_blocks - 1, hashes)

    # ---- PD decode side: sequences awaiting a pushed KV --------------------------------
    def _reserve(self, cmd: ReserveForKv) -> Sequence:
        if cmd.request_id in self.requests:
            raise ValueError(f"request id {cmd.request_id!r} is already in use")
        seq = Sequence(cmd.prompt_token_ids, cmd.params, cmd.request_id,
                       arrival=time.monotonic())
        self.scheduler.reserve_for_kv(seq)          # CapacityError when full
        self.requests[seq.request_id] = seq
        return seq

    def _admit(self, cmd: AdmitPrefilled) -> Sequence:
        seq = cmd.seq
        if self.requests.get(seq.request_id) is not seq \
                or seq.status is not SequenceStatus.WAITING_FOR_KV:
            raise ValueError(f"request {seq.request_id} is no longer reserved")
        if cmd.first_logprob is not None and seq.params.logprobs is not None:
            seq.logprobs.append(cmd.first_logprob)
        self.counters["prompt_tokens"] += seq.num_prompt_tokens
        self.counters["generated_tokens"] += 1
        if cmd.mtp is not None:
            from engine.pd_mtp import install_handoff
            install_handoff(self, seq, cmd.mtp, list(cmd.push_block_ids))
        self.scheduler.admit_with_kv(seq, cmd.first_token, self.eos_token_ids)  # may finish
        self._changed[seq.seq_id] = seq
        return seq

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One engine iteration; returns the sequences that gained a token this step."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            for seq in self.scheduler.finish_unschedulable():
                log.warning("request %s needs more KV blocks than the cache holds; "
                            "finishing it", seq.request_id)
                self._changed[seq.seq_id] = seq
            return []
        grew = self.execute(sched)
        for seq in grew:        # stop strings end a sequence before the next step
            self._apply_stop_strings(seq)
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += sched.num_tokens
        self.counters["generated_tokens"] += (len(grew) if self.speculative is None
                                              else self.speculative.last_num_tokens)
        self.counters["requests_finished"] += sum(s.is_finished for s in grew)
        return grew

    def execute(self, sched: SchedulerOutput) -> list[Sequence]:
        if self.connector is None:
            return self._execute(sched)
        with self.connector.step_scope(sched):
            grew = self._execute(sched)
        self.connector.step_done(grew)
        return grew

    def _execute(self, sched: SchedulerOutput) -> list[Sequence]:
        if self.speculative is not None:
            return self.speculative.execute(sched, self.scheduler, self.eos_token_ids)
        fi = self.builder.build_forward_input(sched)
        out = self.worker.step(fi)
        sampled: dict[int, int] = {}
        if out is not None:
            tokens = out.next_tokens.tolist()
            sampled = dict(zip(fi.selected_seq_ids, tokens, strict=True))
            self._record_logprobs(sched, fi.selected_seq_ids, out)
        return self.scheduler.postprocess(sched, sampled, self.eos_token_ids)

    def _record_logprobs(self, sched: SchedulerOutput, seq_ids: list[int], out) -> None:
        if out.logprobs is None:
            return
        by_id = {s.seq_id: s for s in sched.seqs}
        lps = out.logprobs.tolist()
        toks = out.next_tokens.tolist()
        top_t = out.top_tokens.tolist() if out.top_tokens is not None else None
        top_l = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        for row, sid in enumerate(seq_ids):
            seq = by_id[sid]
            k = seq.params.logprobs
            if k is None:
                continue
            seq.logprobs.append(token_logprob(toks[row], lps[row], top_t[row] if top_t else (),
                                              top_l[row] if top_l else (), k))

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            **self.counters,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_blocks - 1,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            **executor_stats(self.worker.executor),
            **(self.speculative.stats() if self.speculative is not None else {}),
        }
