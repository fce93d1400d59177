"""bench/serve_phases.py: per-shape mean phase times from two scrapes of the router's
phase histogram, read from a real router registry (router/metrics.py)."""

from __future__ import annotations

import http.server
import threading

from bench import serve_phases
from router.metrics import RouterMetrics
from router.node_pool import NodePool


def _serve(metrics: RouterMetrics):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = metrics.render()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_means_are_over_the_requests_between_two_scrapes_only():
    metrics = RouterMetrics(NodePool())
    server, url = _serve(metrics)
    try:
        phase = metrics.phase
        phase.labels("prefill").observe(10.0)            # an earlier shape
        before = serve_phases.scrape(url)
        for s in (0.2, 0.4):
            phase.labels("prefill").observe(s)
            phase.labels("queue").observe(s / 2)
        phase.labels("first_token").observe(0.05)
        after = serve_phases.scrape(url)
    finally:
        server.shutdown()
    means = serve_phases.mean_ms(before, after)
    assert set(means) == {"prefill", "queue", "first_token"}
    assert abs(means["prefill"] - 300.0) < 1e-6
    assert abs(means["queue"] - 150.0) < 1e-6
    assert abs(means["first_token"] - 50.0) < 1e-6
    table = serve_phases.phases_table([{"system": "pd", "shape": "c4", "phases_ms": means,
                                        "ttft_p50_ms": 420.0}])
    assert "| pd | c4 | 150 | - | 300 | 50 | - | 420 |" in table


def test_an_unreachable_router_gives_no_phases():
    assert serve_phases.scrape("http://127.0.0.1:9") is None
    assert serve_phases.mean_ms(None, {"queue": (1.0, 1.0)}) == {}
