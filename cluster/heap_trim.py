"""Give the heap memory a node freed back to the OS (glibc `malloc_trim`).

Why (issue 18, a prefill node's RSS grew under load): glibc raises its mmap threshold each
time a large mmapped block is freed (up to 32 MiB), and model loading frees many. From then
on a step's activations and its KV push buffers, megabytes of varying size, come from the
heap instead of mmap, and once freed between smaller blocks that live on, their pages stay
resident: free inside the process, but counted in its RSS. A prefill step's buffers grow
with its batch (up to max_num_batched_tokens tokens), so each larger burst raised the
resident size for good, while Python-level memory (tracemalloc) and malloc's in-use bytes
stayed flat. Decode steps carry one token per sequence and grew far less. MALLOC_ARENA_MAX
does not help: the pages sit in the main arena.

`malloc_trim(0)` gives back the free pages inside the heap (madvise), not only its top. The
engine thread calls `HeapTrimmer.after_step` after each loop iteration: it trims when the
engine goes idle after work, at most once per `min_interval_s`, and once per
`busy_interval_s` under load that never lets it idle. A trim costs about 0.2 ms per MB it
gives back and under 1 ms when there is nothing to give back. Where the C library is not
glibc (musl, macOS) it does nothing; PDSERVE_HEAP_TRIM=0 turns it off."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from typing import Literal

log = logging.getLogger("cluster.heap_trim")


def glibc_malloc_trim() -> Callable[[], int] | None:
    """`malloc_trim(0)` of this process's C library, None when it has none (not glibc)."""
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


def default_trimmer() -> HeapTrimmer:
    """A node's: glibc's malloc_trim, off with PDSERVE_HEAP_TRIM=0 (to measure without it,
    or with an allocator of its own preloaded)."""
    off = os.environ.get("PDSERVE_HEAP_TRIM", "1").strip().lower() in ("0", "off", "false")
    return HeapTrimmer(trim=None if off else "glibc")


class HeapTrimmer:
    def __init__(self, min_interval_s: float = 5.0, busy_interval_s: float = 60.0,
                 trim: Callable[[], int] | Literal["glibc"] | None = "glibc",
                 clock: Callable[[], float] = time.monotonic):
        """trim: the call that gives memory back ("glibc": its malloc_trim, None where the C
        library has none; None: never trim)."""
        self.min_interval_s = min_interval_s
        self.busy_interval_s = busy_interval_s
        self._trim = glibc_malloc_trim() if trim == "glibc" else trim
        self.clock = clock
        self._last = clock()
        self._worked = False            # a step ran since the last trim
        self.trims = 0

    def after_step(self, worked: bool, idle: bool) -> bool:
        """After one loop iteration (`worked`: it ran a step; `idle`: the engine has nothing
        left to do). Returns whether it trimmed."""
        self._worked = self._worked or worked
        if self._trim is None or not self._worked:
            return False
        since = self.clock() - self._last
        if since < (self.min_interval_s if idle else self.busy_interval_s):
            return False
        started = time.perf_counter()
        self._trim()
        self._last, self._worked = self.clock(), False
        self.trims += 1
        log.debug("malloc_trim took %.1f ms", (time.perf_counter() - started) * 1e3)
        return True
