"""Sequence: one request's tokens, its block table and how much of it the KV cache holds."""

from __future__ import annotations

import enum
import itertools

import torch

from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    # PD decode side: its blocks are allocated, its prompt's KV is being pushed by a prefill
    # node; it joins the running batch when the push is complete (Scheduler.admit_with_kv)
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None, arrival: float = 0.0):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.params = params
        self.arrival = arrival
        # time.monotonic() when the scheduler first gave it a running slot (None until
        # then): a node's metrics split queue time from prefill time at this point
        self.first_scheduled: float | None = None
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.block_table: list[int] = []
        # n_kv_cache_tokens in the seed: tokens whose K/V are already in the cache.
        self.num_cached_tokens = 0
        # Tokens of this sequence served from the prefix cache at its (last) admission.
        self.num_prefix_hit_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # One entry per generated token when the request asks for logprobs.
        self.logprobs: list[TokenLogprob] = []
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_prefill(self) -> bool:
        # More than the one newest token lacks KV: prompt (or recompute after preemption).
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, len={len(self)}, cached={self.num_cached_tokens}, "
                f"blocks={self.block_table}, status={self.status.value})")
