"""Optional OpenTelemetry tracing: one trace per request, router to nodes.

Off unless a process is started with `--otel-exporter console|otlp` [PDSERVE_OTEL_EXPORTER]
(`pip install 'pdserve[tracing]'`); off, every function here is a no-op and OpenTelemetry is
never imported. On:

- the router opens a `pdserve.request` span per request (`RequestRun`), records each phase
  of an attempt as a child span (`router.route`: arrival to the first unit picked, queueing
  included; `router.reserve`, `router.prefill`, `router.first_token` on a PD pair,
  `router.aggregated` on an aggregated node; router/metrics.py's PhaseClock) and
  `router.stream` (first token to last), and sends the request span's W3C `traceparent`
  in the gRPC metadata of its Decode and Prefill calls;
- a node continues that trace: `RequestTimer` (cluster/request_timing.py) records the
  call's span and its phases (`queue`, `prefill`, `kv_push` on a prefill node; `admission`
  (reservation, KV wait) and `decode` on a decode node; `queue`, `prefill`, `decode` on an
  aggregated node) once the request is done, with the times it measured.

Spans are built with explicit start and end times and explicit parents, never made
"current": the router's request code runs in async generators, which may be finalized in
another context than they started in, where OpenTelemetry's context tokens cannot be
detached. The request's span travels in a contextvar set at the request's start (each
request runs in its own task). Spans are exported in batches off the serving path.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field

EXPORTERS = ("none", "console", "otlp")
TRACEPARENT = "traceparent"

_tracer = None          # an OpenTelemetry Tracer while tracing is on
_provider = None


@dataclass
class RequestTrace:
    """A request's span at the router, and what its phase spans need."""
    span: object
    start: float                                  # time.monotonic() of the arrival
    routed: bool = False                          # router.route recorded
    attributes: dict = field(default_factory=dict)


_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "pdserve_request_trace", default=None)


def enabled() -> bool:
    return _tracer is not None


def configure(service: str, exporter: str, endpoint: str | None = None) -> None:
    """Export this process's spans: `console` (JSON on stdout), `otlp` (OTLP over gRPC to
    `endpoint`, default OpenTelemetry's OTEL_EXPORTER_OTLP_ENDPOINT or localhost:4317), or
    `none`. ValueError names the flag when the value or the package is wrong."""
    name = (exporter or "none").strip().lower()
    if name not in EXPORTERS:
        raise ValueError(f"--otel-exporter must be one of {', '.join(EXPORTERS)}, got "
                         f"{exporter!r}")
    if name == "none":
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ValueError(f"--otel-exporter {name} needs OpenTelemetry ({exc.name} is "
                         f"missing): pip install 'pdserve[tracing]'") from None
    span_exporter = (ConsoleSpanExporter() if name == "console"
                     else OTLPSpanExporter(endpoint=endpoint) if endpoint
                     else OTLPSpanExporter())
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    install(provider)
    import atexit
    atexit.unregister(_flush_at_exit)             # once, however often configured
    atexit.register(_flush_at_exit)               # flush what is batched at exit


def _flush_at_exit() -> None:
    install(None)


def install(provider) -> None:
    """Trace with this OpenTelemetry TracerProvider (tests give one with an in-memory
    exporter); None turns tracing off. The process-wide OpenTelemetry provider is left
    alone. A replaced provider is shut down (its spans flushed)."""
    global _tracer, _provider
    if _provider is not None and _provider is not provider:
        _provider.shutdown()
    _provider = provider
    _tracer = provider.get_tracer("pdserve") if provider is not None else None


def wall_ns(mono: float) -> int:
    """time.monotonic() value -> epoch nanoseconds (spans carry wall-clock times)."""
    return time.time_ns() - int((time.monotonic() - mono) * 1e9)


def _context(parent):
    """An OpenTelemetry Context from a span, a Context, or None (a new trace)."""
    if parent is None:
        return None
    from opentelemetry import trace
    if isinstance(parent, trace.Span):
        return trace.set_span_in_context(parent)
    return parent


def start_span(name: str, parent=None, start: float | None = None,
               attributes: dict | None = None):
    """A span begun at `start` (monotonic; default now) under `parent`; None when off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=_context(parent), attributes=attributes,
                              start_time=wall_ns(start if start is not None
                                                 else time.monotonic()))


def end_span(span, end: float | None = None, attributes: dict | None = None) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    span.end(end_time=wall_ns(end if end is not None else time.monotonic()))


def record(name: str, parent, start: float, end: float, attributes: dict | None = None):
    """A finished span over [start, end] (monotonic times) under `parent`."""
    span = start_span(name, parent, start, attributes)
    end_span(span, end)
    return span


# ---- the router's request ---------------------------------------------------------------
def begin_request(attributes: dict, parent=None) -> RequestTrace | None:
    """The router's span of a request, made the task's current request trace. parent: the
    client's trace context (`from_carrier` of its headers / metadata), None for a new
    trace."""
    if _tracer is None:
        return None
    now = time.monotonic()
    trace = RequestTrace(start_span("pdserve.request", parent, now, attributes), now)
    _current.set(trace)
    return trace


def current_request() -> RequestTrace | None:
    return _current.get()


def phase(name: str, start: float, end: float) -> None:
    """An attempt's phase (router/metrics.py PhaseClock) under the current request; the
    first one also records `router.route`, the arrival to the first attempt."""
    trace = _current.get()
    if trace is None:
        return
    if not trace.routed:
        trace.routed = True
        record("router.route", trace.span, trace.start, start)
    record(f"router.{name}", trace.span, start, end)


def outgoing() -> list[tuple[str, str]] | None:
    """gRPC metadata carrying the current request's trace context (None when off)."""
    trace = _current.get()
    if trace is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=_context(trace.span))
    return list(carrier.items())


# ---- a node's side -----------------------------------------------------------------------
def incoming(context) -> object | None:
    """The caller's trace context from a gRPC call's invocation metadata (None when off,
    or when the caller sent none: the node then starts a trace of its own)."""
    if _tracer is None:
        return None
    return from_carrier(context.invocation_metadata() or ())


def from_carrier(items) -> object | None:
    """A trace context from (key, value) pairs (gRPC metadata, HTTP headers) holding a W3C
    `traceparent`; None when off or when there is none."""
    if _tracer is None:
        return None
    carrier = {k.lower(): v for k, v in items if k.lower() == TRACEPARENT}
    if not carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    return TraceContextTextMapPropagator().extract(carrier)
