"""The Prometheus Operator component's PrometheusRule is the alert table of
docs/OPERATIONS.md ("Alerts"): the same alert names, expressions and `for` durations, each
with a severity and a summary; the expressions read pdserve samples by their exposed names
(counters under rate() with _total, histogram_quantile over _bucket by le). That each name
is one the code exports is checked against the registries in
tests/cluster/test_node_metrics.py and against live /metrics in
tests/integration/test_node_metrics.py (`alert_metric_names` is shared)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "k8s" / "components" / "prometheus-operator" / "prometheusrule.yaml"
OPERATIONS = REPO / "docs" / "OPERATIONS.md"
_NAME = re.compile(r"\bpdserve_[a-z0-9_]+")
_ROW = re.compile(r"^\| (\w+) \| `(.+)` \| (\w+) \| (.+) \|$")


def rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for group in doc["spec"]["groups"] for r in group["rules"]]


def documented_alerts() -> list[tuple[str, str, str]]:
    """(name, expression, for) of each row of the docs' alert table ('\\|' is a '|')."""
    text = OPERATIONS.read_text()
    section = text[text.index("## Alerts"):]
    section = section[:section.index("\n## ", 1)]
    return [(m.group(1), m.group(2).replace("\\|", "|"), m.group(3))
            for m in map(_ROW.match, section.splitlines()) if m]


def alert_metric_names() -> set[str]:
    return {n for r in rules() for n in _NAME.findall(r["expr"])}


def test_the_rules_are_the_documented_alerts():
    documented = documented_alerts()
    assert len(documented) >= 10
    assert [(r["alert"], r["expr"], r["for"]) for r in rules()] == documented


def test_every_rule_has_a_severity_and_a_summary_and_reads_samples_by_their_names():
    for r in rules():
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert r["annotations"]["summary"], r["alert"]
        expr = r["expr"]
        assert expr.count("(") == expr.count(")"), expr
        assert _NAME.findall(expr), expr
        if "histogram_quantile" in expr:
            assert all(n.endswith("_bucket") for n in _NAME.findall(expr)), expr
            assert "by (le" in expr, expr
        for counter in re.findall(r"rate\((pdserve_[a-z0-9_]+)", expr):
            assert counter.endswith(("_total", "_bucket")), expr

