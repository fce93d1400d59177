"""The engine's command boundary (in the manner of vLLM v1's EngineCore): everything other
threads ask of an engine is a typed command, and everything it gives back is an
`EngineOutput`.

Commands go into a `CommandInbox`; the thread that runs the engine applies them only
between steps (`LLMEngine.run_once`), so no other thread ever touches the scheduler,
a sequence's status or a block table. Each command gets a `concurrent.futures.Future`
for its result (a reservation's blocks, an admitted sequence) or its error. Until a loop
attaches to the inbox (offline use, single-threaded tests), commands apply at once in the
caller's thread: the same code, without the hop.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams


class CapacityError(RuntimeError):
    """The engine is full right now (RESOURCE_EXHAUSTED); retry or go elsewhere."""


# ---- commands ----------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    push: Any = None          # engine.pd_prefill.PushTarget: also push this prefill's KV


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    reason: str = "abort"


@dataclass(frozen=True)
class FinishRequest:
    """End a request with a reason of the caller's (e.g. a stop condition it detected)."""
    request_id: str
    reason: str
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class ReserveForKv:
    """PD decode side: a sequence whose prompt KV a prefill node will push; the scheduler
    allocates its blocks (prefix hits reused) and holds it WAITING_FOR_KV. The result is
    the Sequence (CapacityError when the node is full)."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AdmitPrefilled:
    """PD decode side: every KV block arrived; the sequence joins the running batch with
    the first token (and its logprobs) sampled by the prefill node, and the MTP handoff.
    (A reservation that will not be admitted ends with ReleaseRequest.)"""
    seq: Any
    first_token: int
    first_logprob: TokenLogprob | None = None
    mtp: Any = None           # engine.pd_mtp.MtpHandoff
    push_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReleaseRequest:
    """Forget a request at once, without a final output; its blocks go back (a decode
    node's reservation that will not be admitted)."""
    request_id: str


Command = (AddRequest | AbortRequest | FinishRequest | ReserveForKv | AdmitPrefilled
           | ReleaseRequest)


# ---- what leaves the engine ----------------------------------------------------------
@dataclass
class EngineOutput:
    """What one request gained since its last output: new tokens, their logprobs
    (when asked for), the text delta (stop strings
    applied), and on the last output the finish and usage."""
    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot any thread may read (replaced whole after each step or command)."""
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_hashes: tuple[int, ...] = ()


# ---- the inbox -----------------------------------------------------------------------
class CommandInbox:
    def __init__(self) -> None:
        self._pending: deque[tuple[Command, Future]] = deque()
        self._lock = threading.Lock()
        self._wake: threading.Event | None = None     # set by an attached loop

    def attach(self, wake: threading.Event) -> None:
        """From now on commands queue for the loop that waits on `wake`."""
        self._wake = wake

    @property
    def attached(self) -> bool:
        return self._wake is not None

    def put(self, command: Command) -> Future:
        fut: Future = Future()
        with self._lock:
            self._pending.append((command, fut))
        self._wake.set()
        return fut

    def take(self) -> list[tuple[Command, Future]]:
        with self._lock:
            items = list(self._pending)
            self._pending.clear()
        return items

    def __len__(self) -> int:
        return len(self._pending)
