"""Keep large host allocations in the heap instead of fresh mmap()s (glibc only).

Every decode step allocates per-layer temporaries of several MB (gathered K/V blocks,
scores). Above glibc's mmap threshold each one is a fresh mmap() that the kernel must
fault in page by page and a munmap() on free; in a VM a page fault is costly, and on the
2-core dev box a batch-64 decode forward of SmolLM2 spent most of its time there
(3.9 s -> 0.55 s per forward with this setting, 3x fewer page faults). Raising the mmap
threshold and the trim threshold lets freed blocks be reused by the next layer.

It also keeps every thread on the one main heap (M_ARENA_MAX = 1). A node steps its engine
on a thread of its own, and glibc gives such a thread an arena of 64 MB heaps; a heap whose
memory is all free again goes back to the OS at once, whatever the trim threshold, so a
prefill step's temporaries (tens of MB a layer at 16 x 256 tokens) faulted their pages in
afresh at every step: on a 2-core Xeon VM a served 16-prompt step took 50-90k page faults
(a quarter of its time zeroing pages) against ~22k offline, where the engine runs on the
main thread. With one arena the served step faults only its new KV blocks, as offline.
The arena limit binds threads that first allocate after it is set: a node sets it at the
start of its process (launch/node_main.py), before its threads.

Process-wide and idempotent; a no-op where glibc's mallopt is missing (macOS, musl).
Opt out with PDSERVE_NO_MALLOPT=1.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MMAP_THRESHOLD = 1 << 30      # allocations below 1 GiB come from the heap
_TRIM_THRESHOLD = (1 << 31) - 1    # return memory to the OS only above ~2 GiB of free top
_done = False


def keep_large_allocations_in_heap() -> bool:
    """Returns True when the allocator settings are in effect."""
    global _done
    if _done:
        return True
    if os.environ.get("PDSERVE_NO_MALLOPT") == "1":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
          and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
          and mallopt(_M_ARENA_MAX, 1) == 1)
    if not ok:
        log.info("mallopt refused the heap settings; large host tensors use mmap")
    _done = ok
    return ok


MAX_RESERVE_BYTES = 1 << 30     # under the trim threshold, so glibc keeps it


def step_reserve_bytes(tokens: int, hidden_size: int, intermediate_size: int,
                       kv_bytes_per_token: int, elem_bytes: int) -> int:
    """The heap a step of `tokens` works in, estimated: its widest temporaries (the
    hidden state and its norms, q/k/v, the MLP's gate, up and product: ~8 hidden + 3
    intermediate values a token) and three copies of its KV (a PD push gathers the step's
    blocks and frames them; the receiving side lands them through a buffer), at most 1 GiB.
    SmolLM2-135M bf16 at 4,096 tokens: ~360 MB (measured: a served 16 x 256-token step and
    its push faulted ~200 MB of fresh heap the first time)."""
    activations = tokens * (8 * hidden_size + 3 * intermediate_size) * elem_bytes
    return min(activations + 3 * tokens * kv_bytes_per_token, MAX_RESERVE_BYTES)


def touch_heap(nbytes: int) -> None:
    """Take `nbytes` from the heap, write them and free them: with the settings above their
    pages stay in the heap, resident, for the allocations that follow.

    Why (issue 36): a node's first burst grew its heap by the step's working set, a page
    fault per 4 KB (~9 us each on a VM, where the host backs a page at its first touch):
    the first 16-prompt step of a served burst took 1.3-1.45 s against 0.7-0.85 s for the
    next ones. Touched at start (and again after the heap trimmer gave pages back while
    the node was idle) the burst finds them mapped. vLLM's start-up profile run does the
    same for its allocator."""
    if nbytes <= 0:
        return
    import torch  # here: a node imports this module first thing, to set the heap up

    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(0)
    del buf
