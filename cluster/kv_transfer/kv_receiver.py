"""Decode side of PD PUSH: one `Reservation` per pushed prompt, with an explicit state.

```
            reserve                 first chunk               complete (all KV arrived)
  (none) ----------> RESERVED ------------------> RECEIVING ----------------------> ADMITTED
                        |                             |
                        +------------+----------------+
                                     | release(reason): caller cancelled, prefill failed,
                                     v  push refused, lease expired, node draining
                                 RELEASED
```

Every transition goes through `KvReceiver._transition` (one place: checked against
`ALLOWED`, logged with the request id, counted by state and reason, and reported to
`on_release` for a release, so the node can end the request's stream with the reason).

`reserve` asks the engine (a ReserveForKv command) to hold the sequence in its scheduler
as WAITING_FOR_KV, its prompt's blocks allocated the way a local prefill would: a
prefix-cache hit reuses blocks and is reported as `num_cached_blocks`, and the prefill
node pushes only the rest. The blocks are the sequence's own; the scheduler counts it
against max_num_seqs and knows when waiting requests wait for its blocks. `write`
validates a chunk completely before touching the cache (wrong layer/kind/block
ids/shape/dtype/byte count: refused, nothing written) and copies it into the sequence's
blocks (KVCache.write_blocks: no step touches a sequence awaiting its KV), so KV lands
while the engine computes others. `complete` admits the sequence (an AdmitPrefilled
command) only when every (layer, K/V, block) has arrived; a release ends it with a
ReleaseRequest. The receiver never touches the scheduler or block tables itself: those are
the engine's. Tokens, leases and the drain live here, in the serving layer: the engine
knows nothing of pushes, tokens or leases.

Each reservation carries a random `token` (32 bytes, `secrets`), returned to the caller
of reserve only. `write`, `complete` and `authorize` (what the node checks before a push
header or an abort notice is acted on) need it and the reservation's own request id: a
missing or wrong one raises `PushDenied` and leaves the reservation exactly as it was. A
wrong token never releases anything, or anyone who learned a reservation id (logs, a
guessable counter) could end other users' streams. Leases are capped at `max_lease_s`:
a longer ask is clamped (the granted lease is `Reservation.lease_s`), not refused, so a
router configured with a longer lease still works against a stricter node.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
import secrets
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future

import torch

from cluster.kv_transfer.reservation import (
    ALLOWED,
    Draining,
    PushDenied,
    PushRejected,
    ReleaseReason,
    Reservation,
    ReservationState,
    UnknownReservation,
)
from engine.commands import AdmitPrefilled, CapacityError, ReleaseRequest, ReserveForKv
from engine.logprobs import TokenLogprob
from engine.pd_mtp import check_handoff
from engine.sampling_params import SamplingParams

__all__ = ["CapacityError", "Draining", "KvReceiver", "PushDenied", "PushRejected",
           "Reservation",
           "ReleaseReason", "ReservationState", "UnknownReservation", "KEY", "VALUE",
           "KEY_VALUE"]

log = logging.getLogger(__name__)

KEY, VALUE, KEY_VALUE = 0, 1, 2     # KEY_VALUE: K and V of a layer run in one chunk
TOKEN_BYTES = 32


class KvReceiver:
    def __init__(self, engine, default_lease_s: float = 30.0,
                 on_release: Callable[[Reservation], None] | None = None,
                 max_lease_s: float | None = None):
        """on_release(res): called once per released reservation (any thread).
        max_lease_s: the longest lease a caller may get (default: default_lease_s)."""
        if default_lease_s <= 0:
            raise ValueError(f"default_lease_s must be > 0, got {default_lease_s}")
        self.engine = engine
        self.default_lease_s = default_lease_s
        self.max_lease_s = default_lease_s if max_lease_s is None else max_lease_s
        if self.max_lease_s < default_lease_s:
            raise ValueError(f"max_lease_s {self.max_lease_s} is below the default lease "
                             f"{default_lease_s}")
        self.denied = 0                       # pushes / notices refused for their token
        self.on_release = on_release
        self.lock = threading.Lock()          # guards `reservations` only
        self.reservations: dict[str, Reservation] = {}
        self.transitions: Counter = Counter()  # (state, reason or "") -> count
        self.refusing: str | None = None       # set while draining: why reserve refuses
        self._ids = itertools.count()
        self._dtype_name = str(engine.dtype).removeprefix("torch.")
        self._block_shape = engine.kv_cache.block_shape   # wire layout per block
        self._v_block_shape = engine.kv_cache.v_block_shape
        # what a push carries per layer: K and V, or K alone (MLA's latent cache)
        self._kinds = (KEY, VALUE) if engine.kv_cache.v_head_dim else (KEY,)
        self._elem = torch.empty((), dtype=engine.dtype).element_size()

    # ---- the one place a reservation changes state ---------------------------------
    def _transition(self, res: Reservation, new: ReservationState,
                    reason: ReleaseReason | None = None, detail: str = "") -> bool:
        """Caller holds res.lock. False (nothing done) when the move is not allowed,
        e.g. a second release racing the first."""
        if new not in ALLOWED[res.state]:
            return False
        old, res.state = res.state, new
        if new is ReservationState.RELEASED:
            res.release_reason, res.detail = reason, detail
        self.transitions[(new.value, reason.value if reason else "")] += 1
        log.info("request %s: reservation %s %s -> %s%s", res.request_id, res.reservation_id,
                 old.value, new.value, f" ({reason.value}: {detail})" if reason else "")
        return True

    def lease_for(self, lease_s: float | None) -> float:
        """The lease granted for an ask: the default for none (or <= 0), else the ask
        clamped to max_lease_s."""
        if not lease_s or lease_s <= 0:
            return self.default_lease_s
        return min(lease_s, self.max_lease_s)

    # ---- reserve -------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                lease_s: float | None = None) -> Future:
        """A Future of the Reservation (CapacityError when full, ValueError when the
        prompt is bad or too long, CapacityError naming the drain while draining).
        The lease is `lease_for(lease_s)`; the Reservation carries its push token."""
        eng = self.engine
        lease = self.lease_for(lease_s)
        eng.validate_prompt(prompt_token_ids)          # ValueError: bad/too long prompt
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        bm = eng.block_manager
        need = bm.blocks_needed(len(prompt_token_ids))
        if need > bm.num_blocks - 1:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens needs {need} KV blocks "
                             f"but this decode node's cache has {bm.num_blocks - 1}")
        with self.lock:
            if self.refusing:
                raise Draining(self.refusing)
            if any(r.request_id == request_id for r in self.reservations.values()):
                raise ValueError(f"request id {request_id!r} is already in use")
            rid = f"{uuid.uuid4().hex[:8]}-{next(self._ids)}"
            placeholder = Reservation(rid, request_id, None, 0, math.inf)   # holds the id
            self.reservations[rid] = placeholder
        blocks = eng.submit(ReserveForKv(request_id, list(prompt_token_ids), params))
        out: Future = Future()

        def reserved(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                with self.lock:
                    self.reservations.pop(rid, None)
                if out.set_running_or_notify_cancel():
                    out.set_exception(exc)
                return
            seq = f.result()
            num_cached = seq.num_cached_tokens // bm.block_size
            res = Reservation(rid, request_id, seq, num_cached, time.monotonic() + lease,
                              token=secrets.token_bytes(TOKEN_BYTES), lease_s=lease)
            for layer in range(len(eng.kv_cache.k)):
                for kind in self._kinds:
                    res.pending[(layer, kind)] = set(res.push_block_ids)
            with self.lock:
                refusing = self.refusing
                if refusing:
                    self.reservations.pop(rid, None)
                else:
                    self.reservations[rid] = res
                    self.transitions[(ReservationState.RESERVED.value, "")] += 1
            if refusing:                  # the drain began while the blocks were found
                eng.submit(ReleaseRequest(request_id))
                if out.set_running_or_notify_cancel():
                    out.set_exception(Draining(refusing))
                return
            log.info("request %s: reserved %d blocks (%d from prefix cache) as %s",
                     request_id, len(seq.block_table), num_cached, rid)
            if out.set_running_or_notify_cancel():
                out.set_result(res)
            else:                         # the caller gave up while the blocks were found
                self.release(rid, ReleaseReason.CALLER_CANCELLED, "gone while reserving")

        blocks.add_done_callback(reserved)
        return out

    # ---- receive -------------------------------------------------------------------
    def get(self, reservation_id: str) -> Reservation:
        res = self.reservations.get(reservation_id)
        if res is None or res.seq is None or not res.open:
            raise UnknownReservation(f"unknown or expired reservation {reservation_id!r}")
        return res

    def authorize(self, reservation_id: str, token: bytes,
                  request_id: str | None = None) -> Reservation:
        """The open reservation, when `token` is its token (and `request_id`, if given,
        its request): UnknownReservation when there is none, PushDenied otherwise. Never
        changes the reservation: a forged call cannot end the real request."""
        res = self.get(reservation_id)
        # compare_digest: the time taken does not tell how many leading bytes matched
        if not token or not hmac.compare_digest(bytes(token), res.token):
            why = f"{'missing' if not token else 'wrong'} push token"
        elif request_id is not None and request_id != res.request_id:
            why = f"it does not belong to request {request_id!r}"
        else:
            return res
        self.denied += 1
        log.warning("reservation %s: call refused: %s", reservation_id, why)
        raise PushDenied(f"reservation {reservation_id!r}: {why}")

    def renew(self, reservation_id: str, token: bytes) -> None:
        """The push of this reservation is alive (a keepalive, a chunk): its lease runs
        from now again. A prefill that merely waits in its node's queue keeps its
        reservation; a silent (hung, dead) one still loses it after one lease."""
        res = self.authorize(reservation_id, token)
        # one float store: `expire` reads it unlocked, and sees the old or the new deadline
        res.deadline = max(res.deadline, time.monotonic() + res.lease_s)

    def write(self, reservation_id: str, layer: int, kind: int, block_ids: list[int],
              shape: list[int], dtype: str, data: bytes | memoryview, *, token: bytes,
              num_layers: int = 0) -> None:
        """Validate one chunk fully (token first), then copy it into the reserved blocks.
        kind KEY or VALUE: one layer's K or V; KEY_VALUE: K and V of layers [layer, layer
        + num_layers), shape [num_layers, 2, n, *block]."""
        res = self.authorize(reservation_id, token)
        total = len(self.engine.kv_cache.k)
        if kind not in (*self._kinds, KEY_VALUE):
            names = ", ".join(f"{n} ({k})" for k, n in ((KEY, "K"), (VALUE, "V"),
                                                        (KEY_VALUE, "a layer run"))
                              if k in (*self._kinds, KEY_VALUE))
            raise PushRejected(f"kv kind {kind} is not one this cache takes: {names}")
        if kind != KEY_VALUE and num_layers > 1:
            raise PushRejected(f"a chunk of kind {kind} holds one layer, not {num_layers}")
        run = max(num_layers, 1)
        if not 0 <= layer or layer + run > total:
            raise PushRejected(f"layers [{layer}, {layer + run}) out of range [0, {total})")
        if dtype != self._dtype_name:
            raise PushRejected(f"dtype {dtype!r} does not match this node's {self._dtype_name!r}")
        block = self._v_block_shape if kind == VALUE else self._block_shape
        expected_shape = [len(block_ids), *block]
        if kind == KEY_VALUE:
            expected_shape = [run, len(self._kinds), *expected_shape]
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
            if not res.open:
                raise UnknownReservation(f"reservation {reservation_id!r} ended during the push")
            self._transition(res, ReservationState.RECEIVING)   # no-op once receiving
            cache, ids = self.engine.kv_cache, list(block_ids)
            if kind != KEY_VALUE:
                cache.write_blocks(layer, kind == VALUE, ids, src)
                res.pending[(layer, kind)].difference_update(block_ids)
            for i in range(run if kind == KEY_VALUE else 0):
                for k in self._kinds:
                    cache.write_blocks(layer + i, k == VALUE, ids, src[i, k])
                    res.pending[(layer + i, k)].difference_update(block_ids)
            res.bytes_received += nbytes
            res.chunks_received += 1

    def complete(self, reservation_id: str, first_token: int,
                 first_logprob: TokenLogprob | None = None, mtp=None, *, token: bytes
                 ) -> Future:
        """All KV arrived: a Future of the Sequence admitted into the running batch with
        its first token. An incomplete push is refused (PushRejected, raised here) and
        releases the reservation. mtp: the prefill's engine.pd_mtp.MtpHandoff."""
        eng = self.engine
        res = self.authorize(reservation_id, token)
        with res.lock:
            if not res.open:
                raise UnknownReservation(f"reservation {reservation_id!r} ended during the push")
            problem = None
            missing = res.missing()
            if missing:
                problem = f"push for request {res.request_id} is incomplete: missing {missing}"
            elif not 0 <= first_token < eng.vocab_size:
                problem = f"first token {first_token} is outside the vocabulary"
            elif mtp is not None:
                problem = check_handoff(eng, mtp, len(res.push_block_ids))
            if problem is None:
                self._transition(res, ReservationState.ADMITTED)
        if problem is not None:
            self.release(reservation_id, ReleaseReason.PUSH_REFUSED, problem)
            raise PushRejected(problem)
        with self.lock:
            self.reservations.pop(reservation_id, None)
        log.info("request %s: KV complete (%d chunks, %d bytes), admitting with first "
                 "token %d", res.request_id, res.chunks_received, res.bytes_received,
                 first_token)
        return eng.submit(AdmitPrefilled(res.seq, first_token, first_logprob, mtp,
                                         tuple(res.push_block_ids)))

    # ---- release -------------------------------------------------------------------
    def release(self, reservation_id: str, reason: ReleaseReason, detail: str = ""
                ) -> Reservation | None:
        """Give the blocks back (not once admitted); None when there was nothing to
        release. Reports the release to on_release."""
        res = self.reservations.get(reservation_id)
        if res is None or res.seq is None:
            return None
        with res.lock:
            if not self._transition(res, ReservationState.RELEASED, reason, detail):
                return None
        with self.lock:
            self.reservations.pop(reservation_id, None)
        self.engine.submit(ReleaseRequest(res.request_id))
        if self.on_release is not None:
            self.on_release(res)
        return res

    def release_request(self, request_id: str, reason: ReleaseReason, detail: str = ""
                        ) -> Reservation | None:
        for res in [r for r in self.reservations.values() if r.request_id == request_id]:
            return self.release(res.reservation_id, reason, detail)
        return None

    def expire(self, now: float | None = None) -> list[Reservation]:
        """Release reservations whose lease ran out; returns them."""
        now = time.monotonic() if now is None else now
        late = [r for r in list(self.reservations.values()) if r.deadline <= now]
        return [r for r in late if self.release(r.reservation_id, ReleaseReason.LEASE_EXPIRED,
                                                "lease ran out before the KV push completed")]

    def drain(self, why: str) -> list[Reservation]:
        """Refuse new reservations from now on, and release those whose push has not
        started (they would hold the node up; the router replays them elsewhere).
        Pushes already writing finish and are admitted."""
        with self.lock:
            self.refusing = why
            idle = [r for r in self.reservations.values()
                    if r.seq is not None and r.state is ReservationState.RESERVED]
        return [r for r in idle
                if self.release(r.reservation_id, ReleaseReason.DRAINING, why)]

    def state_counts(self) -> dict[str, int]:
        counts = Counter(r.state.value for r in list(self.reservations.values())
                         if r.seq is not None)
        return {s.value: counts.get(s.value, 0) for s in ReservationState}
