"""Test doubles for the router's boundary to the nodes, and a tiny model folder for it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from engine.logprobs import TokenLogprob
from router.backend import NodeRequest, StepOutput
from tests.tiny_tokenizer import add_tiny_tokenizer

# Token ids of the tiny tokenizer (tests/tiny_tokenizer.py) that decode to mixed text.
TOKENS = [273, 265, 81, 223, 305, 290, 223, 316, 317, 100, 101, 102]


def make_router_model_dir(folder: Path) -> Path:
    """config.json (vocab 320, max length 64, eos 2) plus the tiny tokenizer: all a router
    needs of a model folder."""
    (folder / "config.json").write_text(json.dumps(
        {"vocab_size": 320, "max_position_embeddings": 64, "eos_token_id": 2}))
    return add_tiny_tokenizer(folder)


class ScriptedBackend:
    """Answers every request with `tokens` one per step (logprobs -i/10 with one top entry),
    finishing with `finish`; or raises `error` before the first token."""

    def __init__(self, tokens: list[int], finish: str = "length", error=None):
        self.tokens, self.finish, self.error = tokens, finish, error
        self.requests: list[NodeRequest] = []
        self.closed_early = 0

    def ready(self) -> bool:
        return self.error is None

    async def generate(self, request: NodeRequest):
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        n = min(len(self.tokens), request.params.max_tokens)
        finished = False
        try:
            for i in range(n):
                await asyncio.sleep(0)
                last = i == n - 1
                lps = ([TokenLogprob(self.tokens[i], -i / 10, ((7, -5.0),))]
                       if request.params.logprobs is not None else None)
                yield StepOutput([self.tokens[i]], lps,
                                 finish_reason=(self.finish if n == len(self.tokens)
                                                else "length") if last else None,
                                 num_cached_tokens=4)
            finished = True
        finally:
            if not finished:
                self.closed_early += 1
