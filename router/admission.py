"""The router's admission queue: requests that found every decode node full wait here, in
arrival order, instead of being refused.

FIFO across clients: a request that arrives while others wait joins behind them rather
than racing them for the next free slot, and a waiter that tried and found the nodes full
again keeps its place. Only the head tries; it is woken when a request of this router
leaves a decode node (room may have freed) and otherwise polls every `poll_s` (other
routers' requests free room too). Bounded twice, so overload stays visible: at most
`max_depth` waiters (the next gets 429 at once), and each waits at most its deadline (then
429). Both 429s carry a Retry-After hint.
"""

from __future__ import annotations

import asyncio
from collections import deque

from router.errors import Overloaded


class AdmissionQueue:
    def __init__(self, max_depth: int = 1000, poll_s: float = 0.25):
        if max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {max_depth}")
        self.max_depth = max_depth
        self.poll_s = poll_s
        self._waiters: deque[Turn] = deque()

    @property
    def depth(self) -> int:
        return len(self._waiters)

    def join(self, front: bool = False) -> Turn:
        """A place at the tail (or, for a request that already waited its turn and found
        the nodes full again, at the head); Overloaded at once when the queue is full."""
        if len(self._waiters) >= self.max_depth and not front:
            raise Overloaded(f"every node is full and {len(self._waiters)} requests are "
                             f"already queued (--queue-depth {self.max_depth}); retry later",
                             retry_after_s=1)
        turn = Turn(self)
        if front:
            self._waiters.appendleft(turn)
        else:
            self._waiters.append(turn)
        return turn

    def wake(self) -> None:
        """Room may have freed: let the head try now."""
        if self._waiters:
            self._waiters[0].event.set()

    def _leave(self, turn: Turn) -> None:
        was_head = bool(self._waiters) and self._waiters[0] is turn
        try:
            self._waiters.remove(turn)
        except ValueError:
            return
        if was_head:        # the next one may fit too (several slots may have freed)
            self.wake()


class Turn:
    """One request's place in the queue."""

    def __init__(self, queue: AdmissionQueue):
        self.queue = queue
        self.event = asyncio.Event()

    async def wait(self, deadline: float, waited_s: float) -> None:
        """Return when this request is at the head and woken (or its poll is due);
        Overloaded once `deadline` (loop time) passes."""
        loop = asyncio.get_running_loop()
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise Overloaded(f"every node that could serve stayed full for "
                                 f"{waited_s:g} s (--queue-timeout); retry later",
                                 retry_after_s=max(1, round(waited_s / 10)))
            head = self.queue._waiters and self.queue._waiters[0] is self
            try:
                await asyncio.wait_for(self.event.wait(),
                                       min(left, self.queue.poll_s) if head else left)
            except TimeoutError:
                if head:
                    return          # the head's poll: try again
                continue
            self.event.clear()
            if self.queue._waiters and self.queue._waiters[0] is self:
                return

    def leave(self) -> None:
        self.queue._leave(self)
