"""What a prefill node's steps handed to their pushes and the pushes have not delivered yet,
so the node can keep its turn on shared cores until they have (cluster/core_share.py).

Why (issue 36, PD on one 2-core box): nodes sharing the cores take turns at steps, but a
push's own work (gathering, TLS, the socket copies on both sides, the decode node writing
the blocks into its cache: ~100 ms of CPU for 2,048 tokens) ran after the prefill node
released the turn, beside the decode node's step, whose OpenMP team it preempted: measured
with 8 pushes landing, a 10-sequence decode step took 180-370 ms instead of ~25, and the
prefill step after it ran 20-40% slower. Delivered inside the prefill node's turn, the
transfer has the cores to itself and the steps on either side run clean.

`open()` (engine thread, when a step hands a push its KV) returns a closer; the push closes
it when the transport has taken the step's bytes, or, for the step that ends the prompt,
when the decode node answered the push (its KV written and the sequence admitted). A push
that fails closes everything it opened. `wait(timeout)` is the turn's epilogue: it returns
when nothing is open, or after `timeout` (a decode node that never answers costs the
prefill node at most that much per step).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

HANDOFF_MAX_S = 0.5


class TurnHandoffs:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = 0
        self.timeouts = 0           # epilogues that gave up waiting
        self.waited_s = 0.0         # time turns were kept for deliveries

    @property
    def open_count(self) -> int:
        return self._open

    def open(self) -> Callable[[], None]:
        """One more delivery outstanding; the returned closer ends it (idempotent, any
        thread)."""
        with self._cond:
            self._open += 1
        closed = False

        def close() -> None:
            nonlocal closed
            with self._cond:
                if closed:
                    return
                closed = True
                self._open -= 1
                if self._open == 0:
                    self._cond.notify_all()
        return close

    def wait(self, timeout: float = HANDOFF_MAX_S) -> bool:
        """Block until every opened delivery is closed; False when `timeout` ran out."""
        t0 = time.monotonic()
        with self._cond:
            done = self._cond.wait_for(lambda: self._open == 0, timeout)
        self.waited_s += time.monotonic() - t0
        if not done:
            self.timeouts += 1
        return done
