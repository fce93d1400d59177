"""cluster/omp_threads.py: a node process keeps one OpenMP team, its engine thread's.

Each check runs in a fresh interpreter with 2 torch threads, where every OpenMP team shows
as one more OS thread (a team of 2 is its master plus one worker), and counts the process's
threads around torch work done the way a node does it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import os, threading, torch
from cluster.omp_threads import (run_in_passing_thread, serial_thread_pool,
                                 serial_torch_thread)
torch.set_num_threads(2)
import time
def threads(expect=None):
    # a joined thread leaves /proc/self/task a moment after join() returns: give an
    # expected count a few seconds to show (the count is returned either way)
    deadline = time.monotonic() + 10
    n = len(os.listdir("/proc/self/task"))
    while expect is not None and n != expect and time.monotonic() < deadline:
        time.sleep(0.01)
        n = len(os.listdir("/proc/self/task"))
    return n
def parallel_op():                  # big enough for torch to start an OpenMP team
    x = torch.ones(1 << 22)
    x.add_(1)
    return float(x[0])
def in_thread(fn):
    t = threading.Thread(target=fn); t.start(); t.join()
"""


def _run(body: str) -> str:
    code = PRELUDE + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"},
                         cwd=".")
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="counts threads through /proc (Linux)")


def test_a_thread_that_ran_torch_leaves_a_team_behind():
    # the baseline the rest rely on: without this module, every thread that ran a parallel
    # op keeps an OpenMP worker, even after the thread itself ended
    out = _run("""
        base = threads()
        parallel_op()                        # the main thread's team: +1 worker
        in_thread(parallel_op)               # a team for that thread
        print(threads() - base)
    """)
    assert int(out) >= 1


def test_serial_threads_make_no_team():
    # counted while the helper threads are still alive: a team ends with its thread
    out = _run("""
        base = threads()
        worked, done = threading.Event(), threading.Event()
        def helper():
            assert serial_torch_thread()
            assert parallel_op() == 2.0      # still computes, on this thread alone
            assert torch.get_num_threads() == 1
            worked.set()
            done.wait()
        helper_thread = threading.Thread(target=helper)
        helper_thread.start()
        worked.wait()
        with_helper = threads(expect=base + 1) - base          # the helper alone
        pool = serial_thread_pool(2)
        assert list(pool.map(lambda _: parallel_op(), range(4))) == [2.0] * 4
        with_pool = threads(expect=base + 1 + len(pool._threads)) - base - len(pool._threads)
        pool.shutdown()
        done.set()
        helper_thread.join()
        print(with_helper, with_pool, torch.get_num_threads())
    """)
    with_helper, with_pool, main_threads = out.split()
    assert with_helper == "1"
    assert with_pool == "1"
    assert main_threads == "2"           # only the calling threads' setting changed


def test_a_node_process_keeps_only_the_engine_threads_team():
    # the order of launch/node_main.run_node: load on a passing thread, the main thread
    # serial, then the engine thread and helper threads at work
    out = _run("""
        base = threads()
        assert run_in_passing_thread(parallel_op) == 2.0    # the loader's team ends with it
        after_load = threads(expect=base)
        serial_torch_thread()
        parallel_op()                                       # the event loop's thread
        worked, done = threading.Event(), threading.Event()
        def engine_loop():
            parallel_op()
            worked.set()
            done.wait()
        engine = threading.Thread(target=engine_loop)
        engine.start()
        worked.wait()
        with_engine = threads(expect=base + 2)    # the engine thread and its team's worker
        with serial_thread_pool(2) as pool:                 # the KV data plane's threads
            list(pool.map(lambda _: parallel_op(), range(4)))
        parallel_op()
        print(after_load - base, with_engine - base, threads(expect=base + 2) - base)
        done.set()
    """)
    after_load, with_engine, at_end = out.split()
    assert after_load == "0"
    assert with_engine == "2"
    assert at_end == "2"


def test_run_in_passing_thread_raises_the_error_on_the_caller():
    out = _run("""
        def boom():
            raise ValueError("bad model folder")
        try:
            run_in_passing_thread(boom)
        except ValueError as exc:
            print("raised", exc)
    """)
    assert out == "raised bad model folder"


def test_ctrl_c_during_a_load_ends_the_process():
    import signal
    import time

    # Python ignores SIGINT when it starts with it ignored (a background job): restore the
    # handler a node started from a terminal has
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from cluster.omp_threads import run_in_passing_thread\n"
            "print('loading', flush=True)\nrun_in_passing_thread(lambda: time.sleep(600))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=".")
    try:
        assert proc.stdout.readline().strip() == "loading"
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)        # not the load's 600 s
        assert proc.returncode != 0
        assert "KeyboardInterrupt" in err
    finally:
        proc.kill()
