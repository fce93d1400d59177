"""Nodes that share CPU cores take turns at engine steps (`--core-share-lock FILE`).

Why (issue 17, PD on one 2-core box): a prefill node and a decode node on the same cores
each run their steps with one OpenMP thread per core. Side by side, the decode node stepped
a batch of one request 87 times (30 ms each, weight-bandwidth bound, ~1.3 cores busy)
while the prefill node's 2,048-token chunk took 2.9 s instead of its 1.45 s alone: the
machine spent half its cores on one token per step, and every request of the chunk waited
twice as long for its first token. Taking turns, a step runs with all the cores to itself,
as in one process with chunked prefill; the decode batch grows while a chunk runs, so each
decode step carries more tokens; and a decode step waits at most one prefill step (the
same bound vLLM's mixed batches put on its ITL).

The turn is an exclusive `flock` on a file every node on the machine opens: uncontended it
costs a few microseconds, and the kernel releases it when a process dies, so a killed node
never blocks the others. flock alone does not hand over: the holder, releasing and at once
asking again, usually wins before the woken waiter runs. So a waiter first takes a shared
lock on a second file (`FILE.queue`) and drops it once it holds the turn; the releaser,
seeing that queue held, waits (at most `handoff_max_s`) until the waiter has taken the turn.
Two nodes then alternate strictly while both have work.

Nodes on separate cores or accelerators must not share a lock: they would only wait for
each other. `pdserve up` gives one to the nodes it starts on a CPU device and none when
they are pinned (bench/serve_pinned_up.py) or run on a GPU/NPU.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

# A woken waiter takes the turn within microseconds; on a loaded machine its thread may
# wait for a core a while. The bound only matters for a waiter that never comes (stopped).
HANDOFF_MAX_S = 0.02
HANDOFF_POLL_S = 0.00005


class CoreShare:
    """One node's handle on the machine's turn, for one engine loop.

    The blocking wait happens on a waiter thread of its own, so the engine thread stays free
    to apply commands while another node's step runs (a decode node's reservations and
    landed pushes, which the router and the prefill node wait on): `request(on_grant)` asks,
    `held` says whether the turn is ours, `release()` hands it on."""

    def __init__(self, path: str | os.PathLike, handoff_max_s: float = HANDOFF_MAX_S):
        self.path = Path(path)
        self.handoff_max_s = handoff_max_s
        try:
            self._turn_fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            self._queue_fd = os.open(f"{self.path}.queue", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ValueError(f"--core-share-lock {str(path)!r}: cannot open it ({exc})") from exc
        self.turns = 0
        self.waited_s = 0.0        # time spent waiting for other nodes' steps to end
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._held = False
        self._closed = False
        self._on_grant: Callable[[], None] | None = None
        self._waiter: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._held

    def request(self, on_grant: Callable[[], None]) -> None:
        """Ask for the turn (again: no effect). on_grant runs on the waiter thread once the
        turn is held; it must only wake the engine thread."""
        with self._lock:
            if self._held or self._closed:
                return
            if not self._wanted.is_set():
                try:        # free, and nobody queued for it: take it here, no thread handoff
                    fcntl.flock(self._turn_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass
                else:
                    self._held = True
                    self.turns += 1
                    return
            self._on_grant = on_grant
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._wait_turns, daemon=True,
                                                name="core-share-waiter")
                self._waiter.start()
            self._wanted.set()

    def _wait_turns(self) -> None:
        while True:
            self._wanted.wait()
            if self._closed:
                return
            started = time.perf_counter()
            fcntl.flock(self._queue_fd, fcntl.LOCK_SH)    # "someone is waiting"
            fcntl.flock(self._turn_fd, fcntl.LOCK_EX)
            fcntl.flock(self._queue_fd, fcntl.LOCK_UN)
            with self._lock:
                self._wanted.clear()
                if self._closed:            # closed while we waited: never keep the turn
                    fcntl.flock(self._turn_fd, fcntl.LOCK_UN)
                    return
                self._held = True
                self.turns += 1
                self.waited_s += time.perf_counter() - started
                on_grant = self._on_grant
            if on_grant is not None:
                on_grant()

    def release(self) -> None:
        """Give the turn back and, while another node waits for it, see that it gets it."""
        with self._lock:
            if not self._held:
                return
            self._held = False
            fcntl.flock(self._turn_fd, fcntl.LOCK_UN)
        deadline = time.monotonic() + self.handoff_max_s
        while time.monotonic() < deadline:
            try:
                fcntl.flock(self._queue_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                time.sleep(HANDOFF_POLL_S)
                continue
            fcntl.flock(self._queue_fd, fcntl.LOCK_UN)
            return

    def close(self) -> None:
        """Stop asking and give back a turn held; a waiter thread still in flock gives its
        turn back as soon as it gets it."""
        with self._lock:
            self._closed = True
            self._wanted.set()
            if self._held:
                self._held = False
                fcntl.flock(self._turn_fd, fcntl.LOCK_UN)
