"""Decode side of PD PUSH: reserve blocks for a prompt, receive its KV into them, admit it.

`reserve` allocates the prompt's blocks the way a local prefill would (a prefix-cache hit
reuses blocks and is reported as `num_cached_blocks`: the prefill node pushes only the
rest) and starts a lease. `write` validates a chunk completely before touching the cache
(unknown reservation, wrong layer/kind/block ids/shape/dtype/byte count: refused, nothing
written). `complete` admits the sequence into the running batch with its first token only
when every (layer, K/V, block) has arrived. `release` / `expire` return the blocks.

Thread safety: `lock` guards the scheduler and block manager; the engine loop must hold
it around `engine.step()`. `write` takes only the reservation's own lock, so KV lands in
its (exclusively owned) blocks while the engine computes other sequences.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field

import torch

from engine.engine_core import LLMEngine
from engine.kv_cache import scatter_blocks
from engine.pd_mtp import check_handoff, install_handoff
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)

KEY, VALUE = 0, 1


class CapacityError(RuntimeError):
    """The decode node is full right now (RESOURCE_EXHAUSTED); retry or go elsewhere."""


class UnknownReservation(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown reservation"


class PushRejected(ValueError):
    """A KV chunk or completion that does not fit the reservation; nothing was written."""


@dataclass
class Reservation:
    reservation_id: str
    request_id: str
    seq: Sequence
    num_cached_blocks: int
    deadline: float                       # time.monotonic()
    pending: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: bool = False
    bytes_received: int = 0
    chunks_received: int = 0

    @property
    def block_ids(self) -> list[int]:
        return list(self.seq.block_table)

    @property
    def push_block_ids(self) -> list[int]:
        return self.seq.block_table[self.num_cached_blocks:]

    def missing(self) -> str:
        left = {k: v for k, v in self.pending.items() if v}
        parts = [f"layer {layer} {'KV'[kind]} blocks {sorted(ids)}"
                 for (layer, kind), ids in sorted(left.items())[:4]]
        more = f" and {len(left) - 4} more" if len(left) > 4 else ""
        return ", ".join(parts) + more


class KvReceiver:
    def __init__(self, engine: LLMEngine, default_lease_s: float = 30.0):
        self.engine = engine
        self.default_lease_s = default_lease_s
        self.lock = threading.RLock()
        self.reservations: dict[str, Reservation] = {}
        self._ids = itertools.count()
        self._dtype_name = str(engine.dtype).removeprefix("torch.")
        kv = engine.kv_cache
        self._block_shape = kv.block_shape      # (block_size, heads, head_dim): wire layout
        self._elem = torch.empty((), dtype=engine.dtype).element_size()

    # ---- reserve -------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                lease_s: float | None = None) -> Reservation:
        eng = self.engine
        eng.validate_prompt(prompt_token_ids)          # ValueError: bad/too long prompt
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        bm = eng.block_manager
        need = bm.blocks_needed(len(prompt_token_ids))
        if need > bm.num_blocks - 1:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens needs {need} KV blocks "
                             f"but this decode node's cache has {bm.num_blocks - 1}")
        with self.lock:
            if request_id in eng.requests or any(r.request_id == request_id
                                                 for r in self.reservations.values()):
                raise ValueError(f"request id {request_id!r} is already in use")
            busy = len(eng.scheduler.running) + len(eng.scheduler.waiting)
            if busy + len(self.reservations) >= eng.config.max_num_seqs:
                raise CapacityError(f"decode node is full: {busy} running/waiting and "
                                    f"{len(self.reservations)} reserved of max_num_seqs "
                                    f"{eng.config.max_num_seqs}")
            seq = Sequence(prompt_token_ids, params, request_id, arrival=time.monotonic())
            if not bm.allocate(seq):
                raise CapacityError(f"decode node has {bm.num_free_blocks} free KV blocks, "
                                    f"request {request_id} needs {need}")
            num_cached = seq.num_cached_tokens // bm.block_size
            rid = f"{uuid.uuid4().hex[:8]}-{next(self._ids)}"
            res = Reservation(rid, request_id, seq, num_cached,
                              time.monotonic() + (lease_s or self.default_lease_s))
            push = set(res.push_block_ids)
            for layer in range(len(eng.kv_cache.k)):
                for kind in (KEY, VALUE):
                    res.pending[(layer, kind)] = set(push)
            self.reservations[rid] = res
        log.info("request %s: reserved %d blocks (%d from prefix cache) as %s", request_id,
                 len(seq.block_table), num_cached, rid)
        return res

    # ---- receive -------------------------------------------------------------------
    def get(self, reservation_id: str) -> Reservation:
        res = self.reservations.get(reservation_id)
        if res is None or res.released:
            raise UnknownReservation(f"unknown or expired reservation {reservation_id!r}")
        return res

    def write(self, reservation_id: str, layer: int, kind: int, block_ids: list[int],
              shape: list[int], dtype: str, data: bytes | memoryview) -> None:
        """Validate one chunk fully, then copy it into the reserved blocks."""
        res = self.get(reservation_id)
        num_layers = len(self.engine.kv_cache.k)
        if not 0 <= layer < num_layers:
            raise PushRejected(f"layer {layer} out of range [0, {num_layers})")
        if kind not in (KEY, VALUE):
            raise PushRejected(f"kv kind {kind} is neither K (0) nor V (1)")
        if dtype != self._dtype_name:
            raise PushRejected(f"dtype {dtype!r} does not match this node's {self._dtype_name!r}")
        expected_shape = [len(block_ids), *self._block_shape]
        if list(shape) != expected_shape:
            raise PushRejected(f"shape {list(shape)} does not match {expected_shape} for "
                               f"{len(block_ids)} blocks")
        nbytes = math.prod(expected_shape) * self._elem
        if len(data) != nbytes:
            raise PushRejected(f"chunk has {len(data)} bytes, expected {nbytes}")
        if not block_ids or len(set(block_ids)) != len(block_ids):
            raise PushRejected("block ids must be non-empty and distinct")
        allowed = set(res.push_block_ids)
        stray = [b for b in block_ids if b not in allowed]
        if stray:
            raise PushRejected(f"block ids {stray} are not reserved for this push "
                               f"(reserved: {res.push_block_ids})")
        with warnings.catch_warnings():   # read-only buffers: we only read from them
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        src = src.view(self.engine.dtype).view(expected_shape)
        with res.lock:
            if res.released:
                raise UnknownReservation(f"reservation {reservation_id!r} ended during the push")
            cache = (self.engine.kv_cache.k if kind == KEY else self.engine.kv_cache.v)[layer]
            first = block_ids[0]
            if block_ids == list(range(first, first + len(block_ids))):   # one run: a slice
                cache[:, first:first + len(block_ids)].copy_(src.permute(2, 0, 1, 3))
            else:
                idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
                scatter_blocks(cache, idx, src.to(cache.device, non_blocking=False))
            res.pending[(layer, kind)].difference_update(block_ids)
            res.bytes_received += nbytes
            res.chunks_received += 1

    def complete(self, reservation_id: str, first_token: int,
                 first_logprob: dict[int, float] | None = None, mtp=None) -> Sequence:
        """All KV arrived: admit the sequence with its first token into the running batch.
        An incomplete push is refused and releases the reservation. mtp: the prefill's
        engine.pd_mtp.MtpHandoff, installed for this engine's MTP draft (if it has one)."""
        eng = self.engine
        with self.lock:
            res = self.get(reservation_id)
            with res.lock:
                missing = res.missing()
                if missing:
                    self._release_locked(res, "incomplete push")
                    raise PushRejected(f"push for request {res.request_id} is incomplete: "
                                       f"missing {missing}")
                if not 0 <= first_token < eng.vocab_size:
                    self._release_locked(res, "bad first token")
                    raise PushRejected(f"first token {first_token} is outside the vocabulary")
                bad_mtp = None if mtp is None else check_handoff(eng, mtp,
                                                                 len(res.push_block_ids))
                if bad_mtp is not None:
                    self._release_locked(res, "bad MTP payload")
                    raise PushRejected(bad_mtp)
                res.released = True     # ownership of the blocks moves to the sequence
                del self.reservations[reservation_id]
            seq = res.seq
            seq.num_cached_tokens = len(seq)
            eng.block_manager.cache_full_blocks(seq)
            seq.append_token(first_token)
            if first_logprob is not None and seq.params.logprobs is not None:
                seq.logprobs.append(dict(first_logprob))
            eng.requests[seq.request_id] = seq
            eng.counters["prompt_tokens"] += seq.num_prompt_tokens
            eng.counters["generated_tokens"] += 1
            seq.status = SequenceStatus.RUNNING
            if mtp is not None:
                install_handoff(eng, seq, mtp, res.push_block_ids)
            eng.scheduler.running.append(seq)
            eng.scheduler.check_stop(seq, eng.eos_token_ids)   # may finish it right away
        log.info("request %s: KV complete (%d chunks, %d bytes), admitted with first token %d",
                 res.request_id, res.chunks_received, res.bytes_received, first_token)
        return seq

    # ---- release -------------------------------------------------------------------
    def release(self, reservation_id: str, reason: str) -> Reservation | None:
        with self.lock:
            res = self.reservations.get(reservation_id)
            if res is None:
                return None
            with res.lock:
                self._release_locked(res, reason)
            return res

    def _release_locked(self, res: Reservation, reason: str) -> None:
        if res.released:
            return
        res.released = True
        self.reservations.pop(res.reservation_id, None)
        self.engine.block_manager.free(res.seq)
        res.seq.status = SequenceStatus.FINISHED
        res.seq.finish_reason = "abort"
        log.info("request %s: reservation %s released (%s)", res.request_id,
                 res.reservation_id, reason)

    def expire(self, now: float | None = None) -> list[Reservation]:
        """Release reservations whose lease ran out; returns them."""
        now = time.monotonic() if now is None else now
        with self.lock:
            late = [r for r in self.reservations.values() if r.deadline <= now]
            for res in late:
                with res.lock:
                    self._release_locked(res, "lease expired")
        return late
