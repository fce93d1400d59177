"""The engine loop gives freed heap memory back to the OS (cluster/heap_trim.py): the
trimming policy on a fake clock, the loop calling it, and, in a fresh process, glibc
keeping ~600 MB of freed step buffers resident until the loop goes idle and trims."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from cluster.engine_loop import EngineLoop
from cluster.heap_trim import HeapTrimmer, glibc_malloc_trim

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trims_once_idle_for_a_while_after_work_and_under_steady_load():
    clock, calls = Clock(), []
    t = HeapTrimmer(idle_s=30.0, busy_interval_s=60.0,
                    trim=lambda: calls.append(clock.now) or 1, clock=clock)
    clock.now += 100
    assert not t.after_step(worked=False, idle=True)          # no work since: nothing freed
    assert not t.after_step(worked=True, idle=True)           # went idle just now: a burst's
    for _ in range(59):                                       # gap keeps its working set
        clock.now += 0.5
        assert not t.after_step(worked=False, idle=True)
    clock.now += 0.5
    assert t.after_step(worked=False, idle=True) and calls == [230.0]   # idle 30 s
    clock.now += 0.5
    assert not t.after_step(worked=False, idle=True)          # nothing worked since
    clock.now += 10
    assert not t.after_step(worked=True, idle=False)          # work again...
    clock.now += 20
    assert not t.after_step(worked=False, idle=True)          # ...idle 20 s: not yet
    assert not t.after_step(worked=True, idle=True)           # a step restarts the spell
    clock.now += 29
    assert not t.after_step(worked=False, idle=True)
    clock.now += 1
    assert t.after_step(worked=False, idle=True) and calls == [230.0, 290.5]
    for _ in range(59):                                       # busy, never idle: once a
        clock.now += 1                                        # minute
        assert not t.after_step(worked=True, idle=False)
    clock.now += 1
    assert t.after_step(worked=True, idle=False)
    assert t.trims == 3 and calls == [230.0, 290.5, 350.5]
    clock.now += 100
    assert not HeapTrimmer(trim=None, clock=clock).after_step(True, True)   # no C library


def test_idle_time_from_the_environment(monkeypatch):
    from cluster.heap_trim import IDLE_S, default_trimmer

    monkeypatch.delenv("PDSERVE_HEAP_TRIM_IDLE_S", raising=False)
    assert default_trimmer().idle_s == IDLE_S
    monkeypatch.setenv("PDSERVE_HEAP_TRIM_IDLE_S", "2.5")
    assert default_trimmer().idle_s == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("PDSERVE_HEAP_TRIM_IDLE_S", bad)
        with pytest.raises(ValueError, match="PDSERVE_HEAP_TRIM_IDLE_S"):
            default_trimmer()


class _FakeInbox:
    def attach(self, wake):
        self.wake = wake


class _FakeEngine:
    """Has work for `steps` iterations, each with an output."""

    def __init__(self, steps: int):
        self.inbox, self.left = _FakeInbox(), steps
        self.refills = 0

    def refill_host_reserve(self):
        self.refills += 1

    def run_once(self):
        if self.left:
            self.left -= 1
            return ["out"]
        return []

    def has_work(self) -> bool:
        return self.left > 0

    def settle(self):
        return []


def test_the_engine_loop_trims_once_it_goes_idle_after_steps():
    trimmed = threading.Event()
    engine = _FakeEngine(3)
    loop = EngineLoop(engine, trimmer=HeapTrimmer(
        idle_s=0.0, trim=lambda: trimmed.set() or 1)).start()
    try:
        assert trimmed.wait(5), "the loop went idle after 3 steps without trimming"
    finally:
        loop.stop()
    assert loop.trimmer.trims == 1
    # the idle node maps the heap a step works in again (engine.refill_host_reserve)
    assert engine.refills == 1


_FRAGMENTING_STEPS = textwrap.dedent("""
    import ctypes, json, sys, threading, time
    from cluster.engine_loop import EngineLoop
    from cluster.heap_trim import HeapTrimmer

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    class Engine:
        # like a prefill node under a burst: each step's 1-4 MB buffers (activations, KV
        # push chunks still being sent) come from the heap (a freed 16 MB block raised
        # glibc's mmap threshold, as model loading does) between small blocks that live
        # on; the burst's buffers are all freed when it ends
        def __init__(self):
            self.inbox, self.left, self.keep, self.big = self, 150, [], []
        def attach(self, wake):
            pass
        def run_once(self):
            if not self.left:
                return []
            self.left -= 1
            n = (1 << 20) * (1 + self.left % 4)
            self.big.append(libc.malloc(n))
            libc.memset(self.big[-1], 1, n)
            self.keep.append(libc.malloc(700))
            if not self.left:
                for b in self.big:
                    libc.free(b)
            return ["out"]
        def has_work(self):
            return self.left > 0
        def settle(self):
            return []
        def refill_host_reserve(self):
            pass

    libc.free(libc.malloc(16 << 20))
    trim = sys.argv[1] == "trim"
    trimmer = HeapTrimmer(idle_s=0.0, trim="glibc" if trim else (lambda: 0))
    engine = Engine()
    before = rss_mb()
    loop = EngineLoop(engine, trimmer=trimmer).start()
    while engine.left or not trimmer.trims:
        time.sleep(0.05)
    time.sleep(0.2)
    after = rss_mb()
    loop.stop()
    print(json.dumps({"before": before, "after": after}))
""")


def _fragment(mode: str) -> dict:
    import json
    out = subprocess.run([sys.executable, "-c", _FRAGMENTING_STEPS, mode], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(glibc_malloc_trim() is None or not sys.platform.startswith("linux"),
                    reason="glibc's malloc_trim")
def test_freed_step_buffers_stay_resident_until_the_loop_trims():
    kept = _fragment("no-trim")        # the loop calls a trim that does nothing
    assert kept["after"] - kept["before"] > 200, kept        # glibc kept the freed buffers
    trimmed = _fragment("trim")        # the real malloc_trim
    assert trimmed["after"] - trimmed["before"] < 50, (kept, trimmed)

