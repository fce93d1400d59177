"""What the router's fronts need from whatever runs a request: token ids in, per-step token
batches out. The PD backend (prefill + decode pairs and aggregated nodes over gRPC)
implements it; so does a single in-process engine in tests of the fronts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass
class NodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class StepOutput:
    """The tokens one engine step (or one node message) produced for a request.

    logprobs: one entry per token; None when the request asked for none.
    """
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None     # "stop" | "length" on the last output
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0           # prompt tokens served from a prefix cache
    meta: dict = field(default_factory=dict)   # e.g. which nodes served it (for logs)


class Backend(Protocol):
    def generate(self, request: NodeRequest) -> AsyncIterator[StepOutput]:
        """Token batches until one carries finish_reason. Raises RouterError subclasses
        (NoNodeAvailable, Overloaded, InvalidRequest). Closing the iterator early (aclose)
        aborts the request on the nodes."""
        ...

    def ready(self) -> bool:
        """True when the backend can serve: at least one prefill and one decode node, or
        one aggregated node, can take requests."""
        ...
