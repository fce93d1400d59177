"""One request's times on a node, observed into its NodeMetrics (and, with tracing on,
recorded as its spans: cluster/tracing.py) from what the node's service sees: the call's
arrival, the engine's first schedule of the sequence (`Sequence.first_scheduled`, set on
the engine thread before any output of it exists, so reading it once an output arrived is
safe), and the token batches it streams.

Which phases a role observes (docs/OPERATIONS.md):
- prefill: queue (arrival -> first schedule), prefill (first schedule -> the push done),
  end to end (arrival -> the Prefill reply); spans queue, prefill, kv_push (the first
  layer's KV ready -> the reply);
- decode: decode (first token -> last), time per output token, end to end (the Decode
  call's arrival, reservation and KV wait included -> last token); spans admission
  (arrival -> first token) and decode;
- aggregated: all of them, prefill ending at the first token.
Everything runs on the node's event loop.
"""

from __future__ import annotations

import time

from cluster import tracing
from cluster.node_metrics import NodeMetrics
from cluster.proto_convert import finish_from_proto


class RequestTimer:
    def __init__(self, metrics: NodeMetrics | None, name: str = "node.request",
                 trace_parent=None, request_id: str = ""):
        """metrics None: a service built without metrics (tests): nothing is observed.
        name: the request's span on this node; trace_parent: the caller's trace context
        (tracing.incoming), None for a trace of its own."""
        self.metrics = metrics
        self.request_id = request_id
        self.name = name
        self.trace_parent = trace_parent
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.self_prefilled = False
        self.seq = None           # the engine's Sequence, once the engine took the request
        self.done = False

    def _scheduled(self) -> float | None:
        return getattr(self.seq, "first_scheduled", None)

    def _queued(self, now: float) -> None:
        """Queue and prefill time, once the prompt is done (at `now`)."""
        scheduled = self._scheduled()
        if scheduled is None or self.metrics is None:
            return
        self.metrics.queue_time.observe(max(0.0, scheduled - self.arrival))
        self.metrics.prefill_time.observe(max(0.0, now - scheduled))

    def prefilled(self, push_started: float | None = None) -> None:
        """A prefill node's request: its prompt ran and its KV push completed.
        push_started: when its first layer's KV was ready to send."""
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        self._queued(now)
        if self.metrics is not None:
            self.metrics.e2e.observe(now - self.arrival)
        span = self._span(now)
        if span is not None:
            scheduled = self._scheduled()
            if scheduled is not None:
                tracing.record("queue", span, self.arrival, scheduled)
                tracing.record("prefill", span, scheduled, push_started or now)
            if push_started is not None:
                tracing.record("kv_push", span, push_started, now)

    def tokens(self, n: int, self_prefilled: bool) -> None:
        """A batch of `n` tokens streamed to the caller. self_prefilled: this node ran the
        prompt (aggregated), so its first token ends the queue and prefill phases."""
        if self.done:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self.self_prefilled = self_prefilled
            if self_prefilled:
                self._queued(now)
        self.last_token = now
        self.num_tokens += n

    def finished(self, reason: str | int) -> None:
        """The stream's last event. reason: the finish reason, as the engine names it or as
        a TokenEvent carries it (the proto enum, named here)."""
        if self.done:
            return
        if isinstance(reason, int):
            reason = finish_from_proto(reason) or str(reason)
        self.done = True
        now = time.monotonic()
        m = self.metrics
        if m is not None:
            if self.first_token is not None:
                decode = self.last_token - self.first_token
                m.decode_time.observe(decode)
                if self.num_tokens > 1:
                    m.tpot.observe(decode / (self.num_tokens - 1))
            m.e2e.observe(now - self.arrival)
            m.finished(reason)
        span = self._span(now, {"pdserve.finish_reason": reason,
                                "pdserve.output_tokens": self.num_tokens})
        if span is not None and self.first_token is not None:
            scheduled = self._scheduled()
            if self.self_prefilled and scheduled is not None:
                tracing.record("queue", span, self.arrival, scheduled)
                tracing.record("prefill", span, scheduled, self.first_token)
            elif not self.self_prefilled:
                tracing.record("admission", span, self.arrival, self.first_token)
            tracing.record("decode", span, self.first_token, self.last_token)

    def _span(self, end: float, attributes: dict | None = None):
        """This request's span on the node, [arrival, end] (None when tracing is off)."""
        attrs = {"pdserve.request_id": self.request_id}
        return tracing.record(self.name, self.trace_parent, self.arrival, end,
                              {**attrs, **(attributes or {})})
