"""A node's /metrics listener (cluster/metrics_server.py) and its flag: --metrics-listen /
PDSERVE_METRICS_LISTEN parsed (off by default; a bad value named before the model loads),
a registry served over real HTTP on a free port and parsed by prometheus_client's own
parser, and the port closed again by stop()."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics_server import MetricsServer, metrics_listen
from launch.cli import build_parser
from launch.cli_common import CliError
from launch.node_main import metrics_address


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("value,want", [
    (None, None), ("none", None), ("Off", None), ("", None),
    ("0.0.0.0:9300", ("0.0.0.0", 9300)), ("[::1]:0", ("::1", 0)), (":9300", ("0.0.0.0", 9300)),
])
def test_metrics_listen_values(value, want):
    assert metrics_listen(value) == want


@pytest.mark.parametrize("value", ["9300", "host:port", "host:70000"])
def test_a_bad_metrics_listen_names_the_flag(value):
    with pytest.raises(ValueError, match="--metrics-listen"):
        metrics_listen(value)


def test_the_flag_is_off_by_default_and_read_from_the_environment(monkeypatch):
    for role in ("prefill", "decode", "aggregated"):
        assert metrics_address(parse(role)) is None
    monkeypatch.setenv("PDSERVE_METRICS_LISTEN", "127.0.0.1:9400")
    assert metrics_address(parse("decode")) == ("127.0.0.1", 9400)
    with pytest.raises(CliError, match="--metrics-listen"):
        metrics_address(parse("prefill", "--metrics-listen", "nowhere"))


def test_a_registry_is_served_on_a_free_port_until_stopped():
    registry = CollectorRegistry()
    Counter("pdserve_test_things", "things", registry=registry).inc(3)
    server = MetricsServer(registry, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        assert server.port > 0
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    finally:
        server.stop()
    samples = {s.name: s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples}
    assert samples["pdserve_test_things_total"] == 3.0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_a_port_in_use_is_an_error_naming_the_address():
    registry = CollectorRegistry()
    first = MetricsServer(registry, "127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{first.port}"):
            MetricsServer(registry, "127.0.0.1", first.port)
    finally:
        first.stop()
