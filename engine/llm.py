"""Offline API in vLLM's convention: `LLM(model_dir).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from pathlib import Path

from tqdm import tqdm

from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.output_processor import RequestOutput, make_output
from engine.sampling_params import SamplingParams

Prompt = str | dict


class LLM:
    def __init__(self, model: str | Path, **engine_options):
        """engine_options: EngineConfig's fields. Unlike EngineConfig's own default, the
        offline API maps a CPU engine's KV cache and a step's working heap at start
        (`prefault_memory=True`, as a node does and as vLLM writes its cache at start):
        otherwise each KV page takes its first-write fault inside a step, up to ~9 us in a
        VM whose host has not backed the page yet (in the offline bench, the round where
        pdserve ran first, on memory no process had used yet, was the low one in each of
        three runs: docs/perf/HISTORY.md). Pass `prefault_memory=False` to keep the cache
        lazy (resident only as it is written; a shorter start)."""
        engine_options.setdefault("prefault_memory", True)
        self.config = EngineConfig(model=str(model), **engine_options)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    # ---- public API ----------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = self._broadcast_params(sampling_params, len(prompts))
        # Validate every request before any runs, so a bad one fails the call cleanly.
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        for i, ids in enumerate(encoded):
            try:
                self.engine.validate_prompt(ids)
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
        return self._run(encoded, [p if isinstance(p, str) else None for p in prompts],
                         params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False
             ) -> list[RequestOutput]:
        tok = self._need_tokenizer("chat")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        texts = [tok.apply_chat_template(c, add_generation_prompt) for c in conversations]
        prompts = [{"prompt_token_ids": tok.encode(t, add_special_tokens=False)}
                   for t in texts]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text
        return outs

    def stats(self) -> dict:
        return self.engine.stats()

    # ---- internals -----------------------------------------------------------------
    def _run(self, encoded, texts, params, use_tqdm) -> list[RequestOutput]:
        engine = self.engine
        seqs = []
        try:
            for ids, p in zip(encoded, params, strict=True):
                seqs.append(engine.add_request(f"offline-{next(self._ids)}", ids, p))
            text = {s.request_id: "" for s in seqs}
            pending = set(text)
            bar = tqdm(total=len(seqs), desc="generate", unit="req", disable=not use_tqdm)
            while pending:
                outputs = engine.run_once()
                for out in outputs:
                    text[out.request_id] += out.text
                    if out.finished:
                        pending.discard(out.request_id)
                        bar.update(1)
                if pending and not outputs and not engine.has_work():
                    raise RuntimeError("engine stopped with requests unfinished")
            bar.close()
            return [make_output(s, prompt, text[s.request_id])
                    for s, prompt in zip(seqs, texts, strict=False)]
        finally:
            for seq in seqs:
                engine.release(seq.request_id)    # no-op for finished ones; frees the rest

    def _broadcast_params(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        for i, p in enumerate(sp):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams")
        return sp

    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            return self._need_tokenizer("string prompts").encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Seq) or isinstance(ids, str):
                raise ValueError(f"prompts[{index}]['prompt_token_ids'] must be a list of ints")
            return list(ids)
        raise ValueError(f"prompts[{index}] must be a string or a dict with 'prompt_token_ids'")

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{what} need a tokenizer, and the model folder has no "
                             "tokenizer.json; pass {'prompt_token_ids': [...]} instead")
        return self.tokenizer
