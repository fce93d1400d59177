"""Nodes on shared cores take turns at engine steps (cluster/core_share.py): the turn is held
by one handle at a time, is handed to a queued waiter instead of being taken again by the
one releasing it, is freed when its holder dies, and is never kept by a closed handle; the
engine loop steps only in its turn and still applies commands while it waits.

Two handles in one process stand for two nodes (flock belongs to the open file, not to the
process); the dead-holder case uses a real process, killed with SIGKILL."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster.core_share import CoreShare
from cluster.engine_loop import EngineLoop

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0        # upper bounds only: each wait ends as soon as its event happens


def _share(path: Path) -> CoreShare:
    # a handoff bound far above any scheduling delay: what is tested is the protocol
    return CoreShare(path, handoff_max_s=WAIT_S)


def _queued(path: Path) -> bool:
    """Whether some handle waits for the turn (holds the queue file shared)."""
    fd = os.open(f"{path}.queue", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def test_the_turn_goes_to_the_queued_node_not_back_to_the_one_releasing_it(tmp_path):
    lock = tmp_path / "cores.lock"
    a, b = _share(lock), _share(lock)
    granted_a, granted_b = threading.Event(), threading.Event()
    try:
        a.request(granted_a.set)
        assert a.held and not granted_a.is_set()     # free: taken at once, no waiter thread
        b.request(granted_b.set)
        assert not b.held
        _until(lambda: _queued(lock), "b is queued")
        a.release()                                   # returns once b holds it
        assert b.held and granted_b.is_set()
        a.request(granted_a.set)                      # asking again at once does not barge
        assert not a.held
        _until(lambda: _queued(lock), "a is queued")
        b.release()
        assert granted_a.wait(WAIT_S) and a.held and not b.held
        assert (a.turns, b.turns) == (2, 1)
        assert b.waited_s > 0
    finally:
        a.close()
        b.close()


def test_a_killed_holder_frees_the_turn(tmp_path):
    lock = tmp_path / "cores.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, threading, time\n"
         "from cluster.core_share import CoreShare\n"
         f"s = CoreShare({str(lock)!r}); s.request(lambda: None)\n"
         "assert s.held; print('held', flush=True); time.sleep(600)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    me = _share(lock)
    granted = threading.Event()
    try:
        assert holder.stdout.readline().strip() == "held"
        me.request(granted.set)
        assert not me.held
        _until(lambda: _queued(lock), "this handle is queued")
        os.kill(holder.pid, signal.SIGKILL)
        assert granted.wait(WAIT_S) and me.held
    finally:
        holder.kill()
        holder.wait()
        me.close()


def test_a_handle_closed_while_queued_never_keeps_the_turn(tmp_path):
    lock = tmp_path / "cores.lock"
    a, b, c = _share(lock), _share(lock), _share(lock)
    try:
        a.request(lambda: None)
        b.request(lambda: pytest.fail("a closed handle was granted the turn"))
        _until(lambda: _queued(lock), "b is queued")
        b.close()                       # a node stopping while it waits for its turn
        a.release()
        c.request(lambda: None)     # at once (fast path) or on grant: either way it gets it
        _until(lambda: c.held, "c holds the turn")
        assert not b.held and b.turns == 0
    finally:
        for s in (a, b, c):
            s.close()


def test_an_unopenable_lock_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--core-share-lock .*cannot open it"):
        CoreShare(tmp_path / "no-such-dir" / "cores.lock")


class _Inbox:
    def attach(self, wake):
        self.wake = wake


class _Engine:
    """Has `steps` steps of work; counts the passes that only applied commands."""

    def __init__(self, steps: int):
        self.inbox, self.left = _Inbox(), steps
        self.settles = self.stepped = 0
        self.stepped_without_turn = False
        self.gate: CoreShare | None = None

    def run_once(self):
        if self.left:
            self.stepped_without_turn |= not self.gate.held
            self.left -= 1
            self.stepped += 1
            return ["token"]
        return []

    def has_work(self) -> bool:
        return self.left > 0

    def settle(self):
        self.settles += 1
        return []


def test_the_engine_loop_steps_only_in_its_turn_and_applies_commands_while_waiting(tmp_path):
    lock = tmp_path / "cores.lock"
    other = _share(lock)
    other.request(lambda: None)                  # another node is in the middle of a step
    engine = _Engine(steps=3)
    engine.gate = _share(lock)
    loop = EngineLoop(engine, step_gate=engine.gate).start()
    try:
        _until(lambda: _queued(lock), "the loop asks for its turn")
        settles = engine.settles
        engine.inbox.wake.set()                  # a command arrives (e.g. a reservation)
        _until(lambda: engine.settles > settles, "the command is applied")
        assert engine.stepped == 0
        other.release()                          # the other node's step ends
        _until(lambda: engine.stepped == 3, "the loop runs its steps")
        assert not engine.stepped_without_turn
        _until(lambda: not engine.gate.held, "the loop gives the turn back")
        other.request(lambda: None)
        assert other.held                        # idle, the loop does not hold the turn
    finally:
        loop.stop()
        other.close()
