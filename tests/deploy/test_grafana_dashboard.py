"""deploy/grafana/pdserve-dashboard.json is a dashboard Grafana can import: valid JSON, unique
panel ids, panels inside the 24-column grid without overlaps, every query on the
`datasource` variable with a unique refId, and every PromQL expression naming pdserve
metrics by their exposed sample names (a counter's `_total`, a histogram's `_bucket` under
histogram_quantile). That each name is one the code exports is checked against live
/metrics in tests/integration/test_node_metrics.py and against the registries in
tests/cluster/test_node_metrics.py (`dashboard_metric_names` is shared)."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve-dashboard.json"
_NAME = re.compile(r"\bpdserve_[a-z0-9_]+")


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def dashboard_metric_names(dashboard: dict | None = None) -> set[str]:
    """Every pdserve sample name the dashboard's queries read."""
    dashboard = dashboard if dashboard is not None else load_dashboard()
    return {m for expr in dashboard_exprs(dashboard) for m in _NAME.findall(expr)}


def exported_sample_names(families) -> set[str]:
    """Sample names a scrape can hold, from parsed metric families (prometheus_client's
    parser), including the series of families that have no sample yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",), "summary": ("_sum", "_count", "")}
    names = set()
    for fam in families:
        names.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def test_the_dashboard_is_valid_and_laid_out_on_the_grid():
    dash = load_dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_every_query_uses_the_datasource_variable_and_names_pdserve_samples():
    dash = load_dashboard()
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(graphs) >= 15
    for p in graphs:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            names = _NAME.findall(t["expr"])
            assert names, f"{p['title']}: {t['expr']}"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            if "histogram_quantile" in t["expr"]:
                assert all(n.endswith("_bucket") for n in names), t["expr"]
                assert "by (le" in t["expr"], t["expr"]
            if "rate(" in t["expr"] and "histogram_quantile" not in t["expr"]:
                assert all(n.endswith("_total") for n in names), t["expr"]


def test_the_dashboard_covers_what_operators_watch():
    names = dashboard_metric_names()
    for wanted in ("pdserve_router_time_to_first_token_seconds_bucket",
                   "pdserve_router_inter_token_latency_seconds_bucket",
                   "pdserve_kv_cache_usage_perc", "pdserve_prefix_cache_hits_total",
                   "pdserve_spec_decode_num_accepted_tokens_per_pos_total",
                   "pdserve_kv_push_seconds_bucket", "pdserve_reservations",
                   "pdserve_generation_tokens_total"):
        assert wanted in names, wanted


def test_exported_names_include_families_without_samples_yet():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    Counter("pdserve_a", "a", registry=registry)
    Histogram("pdserve_b_seconds", "b", ["x"], registry=registry)     # no child yet
    exported = exported_sample_names(text_string_to_metric_families(
        generate_latest(registry).decode()))
    assert {"pdserve_a_total", "pdserve_b_seconds_bucket", "pdserve_b_seconds_count"
            } <= exported
    assert "pdserve_a" not in exported and "pdserve_b_seconds" not in exported
