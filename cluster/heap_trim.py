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
engine thread calls `HeapTrimmer.after_step` after each loop iteration (every ~0.5 s while
idle): it trims once the engine has been idle for `idle_s` after work, and once per
`busy_interval_s` under load that never lets it idle. A trim costs about 0.2 ms per MB it
gives back and under 1 ms when there is nothing to give back; what it costs later is that
the next step faults the pages it uses back in (several microseconds each in a VM).

Why idle for a while, not the moment the engine idles (issue 36): a prefill node idles
between bursts of requests, often for a few seconds while their decode runs elsewhere.
Trimmed at once, every burst's first step faulted its whole working set back in: measured
(pdserve up, 2 cores, bf16, bursts of 16 x 256-token prompts 5.5 s apart) 40-80k page
faults a step against 9-25k without the trim, ~0.1-0.3 s of CPU a burst. The working set
a node keeps between bursts is bounded by its step budget; a node quiet for `idle_s` gives
it back. Where the C library is not glibc (musl, macOS) it does nothing;
PDSERVE_HEAP_TRIM=0 turns it off, PDSERVE_HEAP_TRIM_IDLE_S sets `idle_s`."""

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


IDLE_S = 30.0       # a node idle this long after work gives its heap's free pages back


def default_trimmer() -> HeapTrimmer:
    """A node's: glibc's malloc_trim, off with PDSERVE_HEAP_TRIM=0 (to measure without it,
    or with an allocator of its own preloaded)."""
    off = os.environ.get("PDSERVE_HEAP_TRIM", "1").strip().lower() in ("0", "off", "false")
    raw = os.environ.get("PDSERVE_HEAP_TRIM_IDLE_S", "").strip()
    try:
        idle_s = float(raw) if raw else IDLE_S
    except ValueError:
        raise ValueError(f"PDSERVE_HEAP_TRIM_IDLE_S must be a number of seconds, got {raw!r}"
                         ) from None
    if not idle_s >= 0:
        raise ValueError(f"PDSERVE_HEAP_TRIM_IDLE_S must be >= 0, got {raw!r}")
    return HeapTrimmer(idle_s=idle_s, trim=None if off else "glibc")


class HeapTrimmer:
    def __init__(self, idle_s: float = IDLE_S, busy_interval_s: float = 60.0,
                 trim: Callable[[], int] | Literal["glibc"] | None = "glibc",
                 clock: Callable[[], float] = time.monotonic):
        """trim: the call that gives memory back ("glibc": its malloc_trim, None where the C
        library has none; None: never trim)."""
        self.idle_s = idle_s
        self.busy_interval_s = busy_interval_s
        self._trim = glibc_malloc_trim() if trim == "glibc" else trim
        self.clock = clock
        self._last = clock()
        self._worked = False            # a step ran since the last trim
        self._idle_since: float | None = None     # when the current idle spell began
        self.trims = 0

    def after_step(self, worked: bool, idle: bool) -> bool:
        """After one loop iteration (`worked`: it ran a step; `idle`: the engine has nothing
        left to do). Returns whether it trimmed."""
        now = self.clock()
        self._worked = self._worked or worked
        if not idle:
            self._idle_since = None
        elif worked or self._idle_since is None:
            self._idle_since = now          # the idle spell starts after this step
        if self._trim is None or not self._worked:
            return False
        if idle:
            if now - self._idle_since < self.idle_s:
                return False
        elif now - self._last < self.busy_interval_s:
            return False
        started = time.perf_counter()
        self._trim()
        self._last, self._worked = self.clock(), False
        self.trims += 1
        log.debug("malloc_trim took %.1f ms", (time.perf_counter() - started) * 1e3)
        return True
