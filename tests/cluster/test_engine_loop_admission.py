"""cluster/engine_loop.py: after idling, the loop lets a burst of arrivals land before its
first step (a step started on the burst's first request makes the rest wait that whole
step), for at most the window's maximum, and a lone request waits only the quiet time.

Windows here are long (tenths of seconds) so that a loaded machine cannot stretch the
gaps between a test's back-to-back submissions past them."""

from __future__ import annotations

import threading
import time

from cluster.engine_loop import EngineLoop

WAIT_S = 30.0


class _Inbox:
    """Says how many commands wait, as engine/commands.py's CommandInbox does."""

    def __init__(self, engine):
        self.engine = engine

    def attach(self, wake):
        self.wake = wake

    def __len__(self) -> int:
        with self.engine.lock:
            return len(self.engine.pending)


class _Engine:
    """Each step takes every request submitted so far as one batch."""

    def __init__(self):
        self.inbox = _Inbox(self)
        self.pending: list[str] = []
        self.batches: list[list[str]] = []
        self.lock = threading.Lock()
        self.first_step = threading.Event()

    def add(self, rid: str) -> None:
        with self.lock:
            self.pending.append(rid)
        self.inbox.wake.set()

    def run_once(self):
        with self.lock:
            batch, self.pending = self.pending, []
        if batch:
            self.batches.append(batch)
            self.first_step.set()
        return batch

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.pending)

    def settle(self):
        return []


def _loop(engine: _Engine, quiet: float, most: float, *burst: float) -> EngineLoop:
    return EngineLoop(engine, admit_window=(quiet, most, *burst)).start()


def test_a_burst_lands_in_one_step():
    engine = _Engine()
    loop = _loop(engine, quiet=0.5, most=WAIT_S)
    try:
        for i in range(6):           # a few ms apart, as a router fans a batch out
            engine.add(f"r{i}")
            time.sleep(0.02)
        assert engine.first_step.wait(WAIT_S)
        assert engine.batches[0] == [f"r{i}" for i in range(6)]
    finally:
        loop.stop()


def test_arrivals_that_keep_coming_wait_at_most_the_window():
    engine = _Engine()
    loop = _loop(engine, quiet=0.5, most=0.3)
    try:
        for i in range(20):          # one every 0.05 s for a second: never quiet for 0.5 s
            engine.add(f"r{i}")
            time.sleep(0.05)
        deadline = time.monotonic() + WAIT_S
        while sum(map(len, engine.batches)) < 20:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.batches[0][0] == "r0"
        assert len(engine.batches[0]) < 20       # the first step did not wait for them all
    finally:
        loop.stop()


def test_a_lone_request_waits_the_quiet_time_not_the_window():
    engine = _Engine()
    loop = _loop(engine, quiet=0.05, most=10 * WAIT_S)
    try:
        started = time.monotonic()
        engine.add("r0")
        assert engine.first_step.wait(WAIT_S)    # well before the window's 300 s
        assert time.monotonic() - started < WAIT_S
        assert engine.batches == [["r0"]]
    finally:
        loop.stop()



def test_a_burst_widens_the_quiet_time_over_a_gap():
    """A second command within the quiet time makes it a burst: a later gap longer than the
    quiet time (but within the burst's) no longer splits it (a prefill node's window)."""
    engine = _Engine()
    loop = _loop(engine, 0.5, WAIT_S, 10 * WAIT_S)
    try:
        engine.add("r0")
        engine.add("r1")
        time.sleep(1.0)              # twice the quiet time
        engine.add("r2")
        assert engine.first_step.wait(2 * WAIT_S)
        assert engine.batches[0] == ["r0", "r1", "r2"]
    finally:
        loop.stop()


def test_without_a_burst_the_gap_splits_the_steps():
    engine = _Engine()
    loop = _loop(engine, 0.05, WAIT_S, 10 * WAIT_S)
    try:
        engine.add("r0")
        assert engine.first_step.wait(WAIT_S)    # a lone request: the quiet time only
        engine.add("r1")
        deadline = time.monotonic() + WAIT_S
        while len(engine.batches) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.batches == [["r0"], ["r1"]]
    finally:
        loop.stop()
