"""One request's times on a node, observed into its NodeMetrics from what the node's
service sees: the call's arrival, the engine's first schedule of the sequence
(`Sequence.first_scheduled`, set on the engine thread before any output of it exists, so
reading it once an output arrived is safe), and the token batches it streams.

Which phases a role observes (docs/OPERATIONS.md):
- prefill: queue (arrival -> first schedule), prefill (first schedule -> the push done),
  end to end (arrival -> the Prefill reply);
- decode: decode (first token -> last), time per output token, end to end (the Decode
  call's arrival, reservation and KV wait included -> last token);
- aggregated: all of them, prefill ending at the first token.
Everything runs on the node's event loop.
"""

from __future__ import annotations

import time

from cluster.node_metrics import NodeMetrics


class RequestTimer:
    def __init__(self, metrics: NodeMetrics | None):
        """metrics None: a service built without metrics (tests); nothing is observed."""
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.seq = None           # the engine's Sequence, once the engine took the request
        self.done = metrics is None

    def _queued(self, now: float) -> None:
        """Queue and prefill time, once the prompt is done (at `now`)."""
        scheduled = getattr(self.seq, "first_scheduled", None)
        if scheduled is None:
            return
        self.metrics.queue_time.observe(max(0.0, scheduled - self.arrival))
        self.metrics.prefill_time.observe(max(0.0, now - scheduled))

    def prefilled(self) -> None:
        """A prefill node's request: its prompt ran and its KV push completed."""
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        self._queued(now)
        self.metrics.e2e.observe(now - self.arrival)

    def tokens(self, n: int, self_prefilled: bool) -> None:
        """A batch of `n` tokens streamed to the caller. self_prefilled: this node ran the
        prompt (aggregated), so its first token ends the queue and prefill phases."""
        if self.done:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            if self_prefilled:
                self._queued(now)
        self.last_token = now
        self.num_tokens += n

    def finished(self, reason: str) -> None:
        """The stream's last event (finish reason set)."""
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        m = self.metrics
        if self.first_token is not None:
            decode = self.last_token - self.first_token
            m.decode_time.observe(decode)
            if self.num_tokens > 1:
                m.tpot.observe(decode / (self.num_tokens - 1))
        m.e2e.observe(now - self.arrival)
        m.finished(reason)
