"""One OpenMP team per node process: the engine thread's.

torch's CPU build runs intra-op parallelism on GNU OpenMP (libgomp). Every thread that
starts a parallel region gets a team of worker threads of its own, and the team stays
after the region ends. libgomp counts every worker it manages; once that count exceeds the
CPUs, it cuts each idle thread's spin-wait from GOMP_SPINCOUNT to 100 iterations, so at the
end of every region the engine's workers go to sleep, and the next region (a step has about
250) waits for a futex wake. Measured on 2 cores, SmolLM2 bf16, a decode step at batch 16:
30 ms when the engine's thread is the only one that ever ran torch ops, 36 ms when the
main thread had loaded the model first (its team of one worker stayed); served, the node
left a quarter of the machine idle with ~18,000 context switches a second.

So a node loads its model on a thread that ends (`run_in_passing_thread`: its team goes
with it), and every other thread that touches tensors (the event loop, the KV data plane's
threads, the default executor) runs torch on itself alone (`serial_torch_thread`): the
engine loop's thread is the one that builds a team and keeps it.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TypeVar

T = TypeVar("T")


@cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (torch's), or None when there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)        # already loaded: the same library instance
        except OSError:
            continue
    return None


def serial_torch_thread() -> bool:
    """From here on, torch ops called on this thread run on it alone: no OpenMP team is
    made for it. Returns False where the process has no libgomp (nothing to do then)."""
    import torch

    torch.get_num_threads()       # torch sets this thread's OpenMP threads on first use...
    gomp = _libgomp()
    if gomp is None:
        return False
    gomp.omp_set_num_threads(1)   # ...so this comes after; it is this thread's setting only
    return True


def serial_thread_pool(max_workers: int | None = None,
                       thread_name_prefix: str = "") -> ThreadPoolExecutor:
    """A ThreadPoolExecutor whose threads run torch ops serially."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix,
                              initializer=serial_torch_thread)


def run_in_passing_thread(fn: Callable[[], T], name: str = "load") -> T:
    """fn() on a new thread that ends when it returns; its result, or its exception raised
    here. The OpenMP team fn's torch ops made ends with the thread."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    # a daemon: it never keeps the process up once the caller has given up (Ctrl-C)
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
