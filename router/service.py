"""The router's request core, shared by the HTTP and gRPC fronts: runs a parsed request's
choices on the backend, merges their deltas, and records metrics and log lines."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from cluster import tracing
from engine.tokenizer import Tokenizer
from router.backend import Backend, NodeRequest
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.model_info import ModelInfo
from router.output_stream import Delta, RequestResult, stream_request
from router.requests import ParsedRequest

log = logging.getLogger("pdserve.router")


class RouterService:
    def __init__(self, info: ModelInfo, tokenizer: Tokenizer, backend: Backend,
                 metrics: RouterMetrics):
        self.info, self.tokenizer, self.backend, self.metrics = info, tokenizer, backend, metrics

    def run(self, req: ParsedRequest, endpoint: str) -> RequestRun:
        return RequestRun(self, req, endpoint)


class RequestRun:
    """One request's execution. Iterate `events()` for (choice index, Delta); `results`
    holds the per-choice totals. Status metrics are recorded when the iteration ends."""

    def __init__(self, service: RouterService, req: ParsedRequest, endpoint: str):
        self.service, self.req, self.endpoint = service, req, endpoint
        self.results = [RequestResult() for _ in req.prompts]
        self.arrival = time.monotonic()
        self._last_token: list[float | None] = [None] * len(req.prompts)
        self._first_token: float | None = None
        # the client's trace context (a W3C traceparent it sent), set by the front
        self.trace_parent = None

    def _on_tokens(self, index: int, n: int) -> None:
        m, now = self.service.metrics, time.monotonic()
        last = self._last_token[index]
        if last is None:
            m.ttft.labels(self.endpoint).observe(now - self.arrival)
            if self._first_token is None:
                self._first_token = now
        else:
            m.itl.labels(self.endpoint).observe(now - last)
        self._last_token[index] = now
        m.generation_tokens.inc(n)

    def _choice(self, index: int) -> AsyncIterator[Delta]:
        req = self.req
        # The nodes see the router's internal id only: a client's id is not unique, and an
        # id shared with another request would let one abort or join the other there.
        rid = req.internal_id if len(req.prompts) == 1 else f"{req.internal_id}-{index}"
        node_req = NodeRequest(rid, req.prompts[index], req.params[index])
        return stream_request(self.service.backend, self.service.tokenizer, node_req,
                              self.results[index], lambda n: self._on_tokens(index, n))

    async def events(self) -> AsyncIterator[tuple[int, Delta]]:
        status = "ok"
        # with tracing on: this request's span, current for the node calls it makes
        trace = tracing.begin_request({"pdserve.request_id": self.req.internal_id,
                                       "pdserve.endpoint": self.endpoint}, self.trace_parent)
        # The one line that ties the client's id to the internal one the node logs use.
        log.info("[%s] %s: %d prompt(s), %s prompt tokens, internal id %s", self.req.request_id,
                 self.endpoint, len(self.req.prompts), [len(p) for p in self.req.prompts],
                 self.req.internal_id)
        self.service.metrics.prompt_tokens.inc(
            sum(len(p) for p in self.req.prompts[::self.req.n]))
        try:
            if len(self.req.prompts) == 1:
                stream = self._choice(0)
                try:
                    async for delta in stream:
                        yield 0, delta
                finally:
                    await stream.aclose()
            else:
                async for item in self._merged():
                    yield item
        except RouterError as exc:
            status = str(exc.http_status)
            log.warning("[%s] failed: %s", self.req.request_id, exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except Exception:
            status = "500"
            log.exception("[%s] internal error", self.req.request_id)
            raise
        finally:
            m = self.service.metrics
            m.requests.labels(self.endpoint, status).inc()
            if trace is not None:
                self._end_trace(trace, status)
            if status == "ok":
                r = self.results
                m.e2e.labels(self.endpoint).observe(time.monotonic() - self.arrival)
                for x in r:
                    m.finished.labels(x.finish_reason or "unknown").inc()
                log.info("[%s] done: %d tokens, finish %s, %.3f s", self.req.request_id,
                         sum(len(x.token_ids) for x in r), [x.finish_reason for x in r],
                         time.monotonic() - self.arrival)

    def _end_trace(self, trace: tracing.RequestTrace, status: str) -> None:
        ends = [t for t in self._last_token if t is not None]
        if self._first_token is not None:
            tracing.record("router.stream", trace.span, self._first_token, max(ends))
        tracing.end_span(trace.span, attributes={
            "pdserve.status": status,
            "pdserve.output_tokens": sum(len(x.token_ids) for x in self.results)})

    async def _merged(self) -> AsyncIterator[tuple[int, Delta]]:
        """Several prompts run concurrently; their deltas interleave as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int) -> None:
            try:
                async for delta in self._choice(index):
                    await queue.put((index, delta))
                await queue.put((index, done))
            except BaseException as exc:  # noqa: B036 - forwarded to the consumer
                await queue.put((index, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.req.prompts))]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
