"""The CPU engine keeps large host temporaries in the heap: allocating and freeing the same
48 MB tensor repeatedly must not fault its pages in again each time (glibc mallopt)."""

import os
import subprocess
import sys

SCRIPT = r"""
import resource, sys, torch
from engine.device import Device
Device("cpu")
for _ in range(3):
    torch.ones(12 << 20)                    # warm: the first allocation faults once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    torch.ones(12 << 20)                    # 48 MB (above glibc's 32 MB dynamic cap), freed
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env_extra: dict, script: str = SCRIPT, *args: str) -> int:
    """The page faults `script` prints last, run in a fresh process (the heap settings
    are process-wide)."""
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_repeated_large_allocations_reuse_heap_pages():
    with_setting = _faults({})
    without = _faults({"PDSERVE_NO_MALLOPT": "1"})
    # 40 x 48 MB = 12288 pages each time without the setting
    assert without > 40 * 10000, without
    # with it, most allocations reuse resident heap pages; the host's page reclaimer
    # (DAMON on this VM) can still take back a few idle pages, so not zero: seen 0-61k
    # against ~490k without
    assert with_setting < without / 4, (with_setting, without)


THREAD_SCRIPT = r"""
import resource, sys, threading, torch
from engine.host_allocator import keep_large_allocations_in_heap
keep_large_allocations_in_heap()            # before the thread, as a node's main does
faults = []

def engine_thread():
    def step():                             # three 24 MB temporaries alive at once
        a, b, c = (torch.ones(6 << 20) for _ in range(3))
        del a, b, c
    for _ in range(20):
        step()                              # warm: the heap settles (3 left it growing)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

t = threading.Thread(target=engine_thread)
t.start()
t.join()
print(faults[0])
"""


def test_a_worker_threads_temporaries_reuse_heap_pages():
    """A node steps on a thread of its own. glibc would give that thread an arena of 64 MB
    heaps, each handed back to the OS as soon as it is all free, so the next step faulted
    its temporaries in again (seen ~61k faults here with only the thresholds set); with
    every thread on the main heap they are reused."""
    with_setting = _faults({}, THREAD_SCRIPT)
    without = _faults({"PDSERVE_NO_MALLOPT": "1"}, THREAD_SCRIPT)
    # 20 x 3 x 24 MB = 368,640 pages if nothing were reused; seen 61,450 without the
    # settings and with the thresholds alone (glibc reuses some), 0 with them all
    assert without > 30000, without
    assert with_setting < without / 4, (with_setting, without)


RESERVE_SCRIPT = r"""
import resource, sys, torch
from engine.host_allocator import keep_large_allocations_in_heap, touch_heap
keep_large_allocations_in_heap()
if sys.argv[1] == "touch":
    touch_heap(64 << 20)                    # what a node does at start
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(12 << 20)                        # a first step's 48 MB temporary
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_touched_heap_serves_the_first_step_without_faults():
    cold, touched = _faults({}, RESERVE_SCRIPT, "cold"), _faults({}, RESERVE_SCRIPT, "touch")
    assert cold > 10000, cold               # 48 MB of fresh heap: ~12,288 pages
    assert touched < cold / 4, (touched, cold)


def test_the_step_reserve_covers_a_served_step_and_is_capped():
    from engine.host_allocator import MAX_RESERVE_BYTES, step_reserve_bytes

    # SmolLM2-135M bf16, a prefill node's 4,096-token step: its first served burst grew
    # the heap by ~200 MB beyond the KV cache (page faults counted on the node)
    kv_per_token = 30 * 2 * 3 * 64 * 2
    smol = step_reserve_bytes(4096, 576, 1536, kv_per_token, 2)
    assert 200 << 20 < smol < MAX_RESERVE_BYTES
    assert step_reserve_bytes(2048, 576, 1536, kv_per_token, 2) < smol
    # a 7B-sized model at the same budget would ask for more than glibc keeps: capped
    assert step_reserve_bytes(4096, 4096, 11008, 32 * 2 * 8 * 128 * 2, 2) == MAX_RESERVE_BYTES
