"""Where a pdserve request's time before its first token goes, per load shape of
bench/serve.py: the router's `pdserve_router_request_phase_seconds{phase}` histogram
(router/metrics.py) scraped before and after each shape; the mean of each phase over the
shape's requests is the difference of the sums over the difference of the counts."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.common import md_table

METRIC = "pdserve_router_request_phase_seconds"
PHASES = ("queue", "reserve", "prefill", "first_token", "aggregated")


def scrape(base_url: str) -> dict[str, tuple[float, float]] | None:
    """phase -> (sum s, count) from the router's /metrics; None when it cannot be read."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != METRIC:
            continue
        for s in fam.samples:
            phase = s.labels.get("phase")
            if s.name.endswith("_sum"):
                out.setdefault(phase, [0.0, 0.0])[0] = s.value
            elif s.name.endswith("_count"):
                out.setdefault(phase, [0.0, 0.0])[1] = s.value
    return {p: (v[0], v[1]) for p, v in out.items()}


def mean_ms(before: dict | None, after: dict | None) -> dict[str, float]:
    """phase -> mean ms over the requests between two scrapes (phases that moved)."""
    if before is None or after is None:
        return {}
    out = {}
    for phase, (total, count) in after.items():
        t0, c0 = before.get(phase, (0.0, 0.0))
        if count > c0:
            out[phase] = 1e3 * (total - t0) / (count - c0)
    return out


def phases_table(rows: list[dict]) -> str | None:
    rows = [r for r in rows if r.get("phases_ms")]
    if not rows:
        return None
    cells = [[r["system"], r["shape"], *(f"{r['phases_ms'][p]:.0f}"
                                         if p in r["phases_ms"] else "-" for p in PHASES),
              r.get("ttft_p50_ms") and f"{r['ttft_p50_ms']:.0f}"] for r in rows]
    return md_table(["system", "shape", *(f"{p} ms" for p in PHASES), "TTFT p50 ms (client)"],
                    cells)
