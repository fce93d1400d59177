"""The engine loop of a node: a dedicated thread that owns the engine.

Other threads never touch the engine's state: they submit commands
(`engine.submit(...)`, engine/commands.py), which wake this thread; it applies them
between steps and runs a step while there is work (`engine.run_once`). Every output
leaves through one outbox, `outbox(outputs)`, called on this thread (it must only hand
them on, e.g. to an event loop). After work, the heap memory the steps freed goes back to
the OS (cluster/heap_trim.py). An `observer` (the node's metrics snapshot,
cluster/node_metrics.py) runs on this thread after each pass, before the outputs leave, so
what it reads of the engine is never read from another thread and already counts the
tokens a client receives. A `step_gate` (cluster/core_share.py), given to nodes that share
CPU cores, makes each step wait for the node's turn on the machine; while it waits, the
commands that arrive are still applied (a reservation or a landed push waits for no step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cluster.core_share import CoreShare
from cluster.heap_trim import HeapTrimmer, default_trimmer

log = logging.getLogger("cluster.engine_loop")

IDLE_WAIT_S = 0.5     # a command or stop wakes the loop at once; this is only a backstop
# After idling, the first command does not start a step at once: a burst of requests (a
# client's concurrent batch, fanned out by the router) lands over a few milliseconds, and a
# step started on its first request makes the rest wait that whole step (a 256-token
# prefill is ~0.25 s on 2 CPU cores). The loop waits until no command came for
# ADMIT_QUIET_S, at most ADMIT_MAX_S; a lone request pays ADMIT_QUIET_S.
ADMIT_QUIET_S = 0.003
ADMIT_MAX_S = 0.025
# A prefill node's window once a second command came within the quiet time (a burst): the
# router reserves each request on a decode node before its Prefill call, one request after
# another, so a burst reaches the prefill node with gaps of up to tens of milliseconds
# (measured under `vllm bench serve` at 16 concurrent: the first 2 requests, then 41 ms,
# then 14 over 33 ms). Stepping on the first two made the other 14 wait a whole step, and a
# small prefill step is a slow one per token (AMX tiles half empty: 2 x 256 tokens 0.31 ms a
# token, 8 x 256 0.20 ms). With the wider window each burst of 16 took one step (TTFT p99
# 1.60 s in that run against 1.88-2.02 s in the runs beside it without). A lone request
# still waits only ADMIT_QUIET_S; commands are counted from the inbox, so two that land
# between two wakes of the loop count as two.
DEFAULT_ADMIT_WINDOW = (ADMIT_QUIET_S, ADMIT_MAX_S)
PREFILL_ADMIT_WINDOW = (ADMIT_QUIET_S, 0.1, 0.045)     # aggregated nodes too: they prefill


class EngineLoop:
    def __init__(self, engine, outbox: Callable[[list], None] | None = None,
                 name: str = "engine", trimmer: HeapTrimmer | None = None,
                 observer: Callable[[], None] | None = None,
                 step_gate: CoreShare | None = None,
                 before_release: Callable[[], object] | None = None,
                 admit_window: tuple[float, ...] = DEFAULT_ADMIT_WINDOW):
        """trimmer: gives freed heap memory back to the OS after work (cluster/heap_trim.py;
        default: glibc's malloc_trim unless PDSERVE_HEAP_TRIM=0). observer: called on this
        thread after every pass (and when idle, every IDLE_WAIT_S). step_gate: a step runs
        only in this node's turn (cluster/core_share.py). before_release: with a step
        gate, what must finish in this node's turn after each step (a prefill node's pushes
        delivering the step's KV: cluster/kv_transfer/handoff.py). admit_window: (quiet, max)
        seconds the loop lets arrivals settle after idling ((0, 0): step at once), or
        (quiet, max, burst_quiet): the quiet time becomes burst_quiet once a second command
        came within the first quiet time."""
        self.engine = engine
        self.outbox = outbox
        self.observer = observer
        self.trimmer = trimmer if trimmer is not None else default_trimmer()
        self.step_gate = step_gate
        self.before_release = before_release
        self._idle = True
        self.admit_quiet_s, self.admit_max_s = admit_window[:2]
        self.admit_burst_quiet_s = admit_window[2] if len(admit_window) > 2 else admit_window[0]
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> EngineLoop:
        self.engine.inbox.attach(self._wake)      # commands queue for this thread now
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self.step_gate is not None:
            self.step_gate.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        eng = self.engine
        gate = self.step_gate
        while not self._stop.is_set():
            self._wake.clear()       # a command put after this sets it again: no lost wake
            if self._idle:           # once per idle spell, not on each wake for a turn
                self._let_arrivals_settle()
                self._idle = False
            if gate is not None and not self._take_turn():
                continue
            try:
                # what the commands made goes out before the step, not after it: an
                # admitted push's first token (a decode node) would otherwise wait for the
                # decode step that follows, and be streamed with the second token
                early = eng.settle()
                if early:
                    self._deliver(early)
                outputs = eng.run_once()
            except Exception as exc:  # noqa: BLE001 - report, keep the node up
                log.exception("engine step failed; aborting the batch")
                self.error = exc
                outputs = eng.abort_all()
            finally:
                if gate is not None:
                    self._finish_turn()
                    gate.release()
            self._deliver(outputs)
            self._idle = not eng.has_work()
            self._trim_heap(worked=bool(outputs), idle=self._idle)
            if self._idle:
                self._wake.wait(IDLE_WAIT_S)
        # what was submitted before the stop still happens (blocks freed, aborts applied)
        self._deliver(eng.settle())

    def _let_arrivals_settle(self) -> None:
        """Wait while commands keep coming (each within the quiet time of the last; once two
        came, admit_burst_quiet_s), at most admit_max_s; the step that follows applies them
        all (until then they wait in the inbox, which counts them)."""
        if self.admit_quiet_s <= 0:
            return
        deadline = time.monotonic() + self.admit_max_s
        arrived = 0
        while not self._stop.is_set():
            arrived = max(arrived, self._commands_waiting())
            quiet = self.admit_burst_quiet_s if arrived >= 2 else self.admit_quiet_s
            left = deadline - time.monotonic()
            if left <= 0 or not self._wake.wait(min(quiet, left)):
                return
            self._wake.clear()
            arrived += 1

    def _commands_waiting(self) -> int:
        """Commands in the engine's inbox (two that landed between two wakes of this thread
        count as two); 0 for an inbox that does not say."""
        try:
            return len(self.engine.inbox)
        except TypeError:
            return 0

    def _take_turn(self) -> bool:
        """With a step gate: True once this node holds the turn. Until then the commands
        that arrive are applied (settle) and their outputs delivered, and it asks for the
        turn only while there is work; False after waiting for a grant, a command or a
        stop."""
        eng, gate = self.engine, self.step_gate
        if eng.has_work():
            gate.request(self._wake.set)     # held at once when no other node is stepping
        if gate.held:
            return True
        outputs = eng.settle()
        self._deliver(outputs)
        work = eng.has_work()
        if work:
            gate.request(self._wake.set)
        if gate.held:
            return True
        self._trim_heap(worked=bool(outputs), idle=not work)
        self._idle = not work
        self._wake.wait(IDLE_WAIT_S)
        return False

    def _trim_heap(self, worked: bool, idle: bool) -> None:
        """Freed heap back to the OS (cluster/heap_trim.py); after a trim while idle the
        engine maps the heap a step works in again, so the next burst does not fault it."""
        if self.trimmer.after_step(worked=worked, idle=idle) and idle:
            self.engine.refill_host_reserve()

    def _finish_turn(self) -> None:
        if self.before_release is None:
            return
        try:
            self.before_release()
        except Exception:  # noqa: BLE001 - never keep the turn, nor stop the loop, for it
            log.exception("engine loop: work before releasing the turn failed")

    def _deliver(self, outputs: list) -> None:
        self._observe()
        if outputs and self.outbox is not None:
            self.outbox(outputs)

    def _observe(self) -> None:
        if self.observer is None:
            return
        try:
            self.observer()
        except Exception:  # noqa: BLE001 - metrics must never stop the engine
            log.exception("engine loop observer failed")
