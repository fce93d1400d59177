"""A node's Prometheus endpoint: GET /metrics on its own HTTP listener (`--metrics-listen`),
served by prometheus_client's threaded WSGI server, apart from the gRPC port (which speaks
only gRPC, possibly with mutual TLS that a scraper does not have)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("cluster.metrics")

OFF = ("", "none", "off")


def metrics_listen(value: str | None) -> tuple[str, int] | None:
    """HOST:PORT -> (host, port); None when metrics are off. ValueError names the flag."""
    if value is None or value.strip().lower() in OFF:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--metrics-listen must be HOST:PORT or none, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class MetricsServer:
    """Serves `registry` at http://HOST:PORT/metrics (port 0: any free port; `port` says
    which) in a daemon thread, until `stop`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        try:
            self._httpd, self._thread = start_http_server(port, host, registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc}") from None
        self.host = host
        self.port = self._httpd.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
