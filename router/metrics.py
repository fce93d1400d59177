"""Prometheus metrics of one router (its own CollectorRegistry, so several routers can live
in one process, as in tests).

TTFT and inter-token latency are measured at the router, as a client sees them; per-node
load is read from the node pool at scrape time, so departed nodes disappear from /metrics.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cluster import tracing
from cluster.discovery.records import ROLES
from router.node_pool import NodePool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)


class _NodeLoadCollector(Collector):
    def __init__(self, pool: NodePool):
        self.pool = pool

    def collect(self):
        labels = ["node", "role"]
        fams = {
            "running": GaugeMetricFamily("pdserve_node_running_requests",
                                         "Requests running on the node (as it published)",
                                         labels=labels),
            "waiting": GaugeMetricFamily("pdserve_node_waiting_requests",
                                         "Requests waiting on the node (as it published)",
                                         labels=labels),
            "free_blocks": GaugeMetricFamily("pdserve_node_free_kv_blocks",
                                             "Free KV blocks on the node (as it published)",
                                             labels=labels),
            "inflight": GaugeMetricFamily("pdserve_router_node_inflight_requests",
                                          "Requests this router has on the node now",
                                          labels=labels),
        }
        for node in self.pool.all():
            for attr, fam in fams.items():
                fam.add_metric([node.node_id, node.role], float(getattr(node, attr)))
        yield from fams.values()
        # what the router can route to now: registered and not held as failed
        ready = GaugeMetricFamily("pdserve_router_ready_nodes",
                                  "Nodes of each role this router can route to now",
                                  labels=["role"])
        for role in ROLES:
            ready.add_metric([role], float(len(self.pool.nodes(role))))
        yield ready


class PhaseClock:
    """The phases of one attempt on a unit, in order: `end(phase)` observes the time since
    the previous phase ended (or the attempt began), once per phase; later calls for a
    phase already ended do nothing (a Prefill reply that lands after the first token).
    With tracing on, each phase is also a span of the request (cluster/tracing.py)."""

    def __init__(self, histogram: Histogram):
        self._histogram = histogram
        self._last = time.monotonic()
        self._ended: set[str] = set()

    def end(self, phase: str) -> None:
        if phase in self._ended:
            return
        now = time.monotonic()
        self._ended.add(phase)
        self._histogram.labels(phase).observe(now - self._last)
        tracing.phase(phase, self._last, now)          # a span, when tracing is on
        self._last = now


class RouterMetrics:
    def __init__(self, pool: NodePool):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_router_time_to_first_token_seconds",
                              "Time from request arrival to its first token", ["endpoint"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_router_inter_token_latency_seconds",
                             "Time between consecutive token batches of a request",
                             ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        # where a request's time to first token goes, measured at the router: queue (arrival
        # -> a unit picked, admission waits included), reserve (Decode call -> Reservation),
        # prefill (Reservation -> the first token the prefill node streams ahead of its push:
        # its queue and forward; or, when it streams none, -> Prefill's reply, the KV push
        # included), first_token (then -> the first token: ~0 when streamed ahead, else
        # admission on the decode node and its first step), aggregated (the call -> the
        # first token on an aggregated node); docs/PERFORMANCE.md reads them under load
        # (bench/serve.py)
        self.phase = Histogram("pdserve_router_request_phase_seconds",
                               "Time of each phase before a request's first token",
                               ["phase"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router_e2e_request_latency_seconds",
                             "Arrival to the last token of requests that succeeded",
                             ["endpoint"], buckets=_LATENCY_BUCKETS + (60.0, 120.0),
                             registry=r)
        self.finished = Counter("pdserve_router_finished_requests",
                                "Choices that succeeded, by finish reason (stop, length, ...)",
                                ["finish_reason"], registry=r)
        # one attempt on a unit that did not give the request its tokens: which side
        # (role) and why: node_down (dropped, the request replayed elsewhere) or the
        # refusal's gRPC code (resource_exhausted, failed_precondition, ...: another unit)
        self.attempt_failures = Counter("pdserve_router_attempt_failures",
                                        "Attempts that failed, by the failing role and reason",
                                        ["role", "reason"], registry=r)
        # requests answered 500 because consecutive attempts failed with the same cause
        # (router/pd_backend.py): which side and the refusal's gRPC code
        self.repeated_failures = Counter("pdserve_router_repeated_failures",
                                         "Requests given up because consecutive attempts "
                                         "failed with the same cause",
                                         ["role", "reason"], registry=r)
        self.requests = Counter("pdserve_router_requests",
                                "Finished requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens served",
                                     registry=r)
        self.generation_tokens = Counter("pdserve_router_generation_tokens",
                                         "Tokens generated", registry=r)
        self.replays = Counter("pdserve_router_replays",
                               "Requests replayed on another node pair after a node failure "
                               "(or a node refusing mid-stream)",
                               registry=r)
        # set to the admission queue's depth by the backend (read at scrape time)
        self.queued = Gauge("pdserve_router_queued_requests",
                            "Requests waiting in the admission queue for room on a decode node",
                            registry=r)
        self.node_failures = Counter("pdserve_router_node_failures",
                                     "Node calls that failed and dropped the node", ["role"],
                                     registry=r)
        r.register(_NodeLoadCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)
