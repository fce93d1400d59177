"""LLMEngine: owns the model, KV cache, scheduler, builder and worker; one `step()` runs
schedule -> build_forward_input -> Worker.step -> postprocess (seed section 0).

Token ids in, token ids out; text (tokenizer, stop strings) is layered on top by
engine/output_processor.py so the nodes can reuse this core.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.device import Device
from engine.executor.graph_buckets import GraphOptions
from engine.executor.graph_stats import executor_stats
from engine.input_builder import BatchInputBuilder
from engine.kv_cache import KVCache
from engine.models.loader import load_model
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.worker import Worker

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


def resolve_dtype(requested: str, model_dtype: str | None, device: Device) -> torch.dtype:
    """`auto` takes the folder's dtype, except on a CPU that lacks native half-precision
    matmuls (AVX2 only), where float32 is several times faster than emulated bf16/fp16."""
    if requested != "auto":
        return _DTYPES[requested]
    dtype = _DTYPES.get(str(model_dtype).replace("torch.", ""), torch.float32)
    if device.is_cpu and dtype is not torch.float32:
        if not cpu_has_native_bf16():
            log.info("dtype auto: this CPU has no native bf16 (%s); computing in float32",
                     torch.backends.cpu.get_cpu_capability())
            return torch.float32
        return torch.bfloat16        # fp16 matmuls are very slow on CPUs
    return dtype


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = Device(config.device)
        from engine.models.model_config import ModelConfig
        mcfg = ModelConfig.from_folder(config.model)
        self.dtype = resolve_dtype(config.dtype, mcfg.torch_dtype, self.device)
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        self.model, self.model_config = load_model(config.model, self.dtype,
                                                   self.device.torch_device,
                                                   config.attention_backend)
        log.info("loaded %s (%s) in %.1fs", config.model, self.dtype, time.perf_counter() - t0)
        if self.device.is_cpu:
            # build (or load the cached) CPU attention kernel now, not in the first request
            from engine.layers import cpu_paged_attention
            cpu_paged_attention.kernel()
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        bs = config.block_size
        num_blocks = config.num_gpu_blocks or self._blocks_for_memory()
        self.kv_cache = KVCache(mc.num_hidden_layers, num_blocks, bs, mc.num_key_value_heads,
                                mc.head_dim, self.dtype, self.device.torch_device)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   config.enable_chunked_prefill)
        self.builder = BatchInputBuilder(bs, mc.vocab_size, config.min_decoding_batch_size)
        graph = (GraphOptions.from_engine_config(config, self.max_model_len)
                 if config.enable_graph else None)
        self.worker = Worker(self.model, self.kv_cache, self.device, graph)
        self.speculative = None     # SpeculativeWorker when speculative_method is set
        if config.speculative_method is not None:
            from engine.speculative import build_speculative_worker
            self.speculative = build_speculative_worker(self)
        self.requests: dict[str, Sequence] = {}
        self.counters = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0,
                         "computed_tokens": 0, "requests_finished": 0}

    def _blocks_for_memory(self) -> int:
        mc, cfg = self.model_config, self.config
        per_block = KVCache.bytes_per_block(mc.num_hidden_layers, cfg.block_size,
                                            mc.num_key_value_heads, mc.head_dim, self.dtype)
        by_memory = int(cfg.kv_cache_memory_gb * (1 << 30)) // per_block
        # never more than the running sequences could ever use, plus the padding block
        by_need = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size) + 1
        return max(2, min(by_memory, by_need))

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
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

    def release(self, request_id: str) -> None:
        """Forget a finished request (its blocks are already free)."""
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One engine iteration; returns the sequences that gained a token this step."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._unblock()
            return []
        grew = self.execute(sched)
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += sched.num_tokens
        self.counters["generated_tokens"] += (len(grew) if self.speculative is None
                                              else self.speculative.last_num_tokens)
        self.counters["requests_finished"] += sum(s.is_finished for s in grew)
        return grew

    def execute(self, sched: SchedulerOutput) -> list[Sequence]:
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
            entry = {toks[row]: lps[row]}
            if top_t is not None:
                for t, lp in zip(top_t[row][:k], top_l[row][:k], strict=True):
                    entry.setdefault(t, lp)
            seq.logprobs.append(entry)

    def _unblock(self) -> None:
        """Nothing could be scheduled although requests wait: the head request cannot
        fit in the whole KV pool. Finish it rather than spin forever."""
        sch = self.scheduler
        if sch.waiting and not sch.running:
            seq = sch.waiting[0]
            log.warning("request %s needs more KV blocks than the cache holds; finishing it",
                        seq.request_id)
            sch.finish(seq, "length")

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
