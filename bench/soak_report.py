"""The soak's summary (soak.json) and its markdown (soak.md)."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

# etcd's database is flat when its file's largest size in the second half of the run
# (after warm-up) is at most this above the first half's: it stopped growing once
# compaction kept pace. bbolt grows its file in steps and never shrinks it without a
# defrag, so a step or two of slack.
ETCD_FLAT_SLACK_BYTES = 1 << 20


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def _counter_total(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def summarize(opts, results, faults, watch, metrics: str, restarts: list[float],
              fatal: list[str], seconds: float) -> dict:
    failed = [r for r in results if r.error]
    mismatched = [r for r in results if r.mismatch]
    ok = [r for r in results if not r.error]
    rss = watch.rss_report(opts.warmup_s, opts.rss_limit)
    etcd = watch.etcd_report(opts.warmup_s)
    grew = (etcd["max_second_half"] - etcd["max_first_half"]) if etcd else 0
    etcd_flat = bool(etcd) and grew <= ETCD_FLAT_SLACK_BYTES
    drift_bad = [r for r in rss if r.get("within") is False]
    unrecovered = [f for f in faults if f.error or f.recovered_after is None]
    report = {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
        "seconds": round(seconds, 1),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "requests": {
            "total": len(results), "failed": len(failed), "mismatched": len(mismatched),
            "by_via": dict(Counter(r.via for r in results)),
            "latency_s": {"p50": _pct([r.seconds for r in ok], 0.5),
                          "p99": _pct([r.seconds for r in ok], 0.99),
                          "max": _pct([r.seconds for r in ok], 1.0)},
            "stall_s": {"p99": _pct([r.stall for r in ok], 0.99),
                        "max": _pct([r.stall for r in ok], 1.0)},
            "errors": [f"t={r.start:.1f}s {r.via}: {r.error}" for r in failed[:20]],
            "mismatches": [f"t={r.start:.1f}s {r.via} #{r.index}: {r.mismatch}"
                           for r in mismatched[:10]],
        },
        "faults": [vars(f) for f in faults],
        "supervisor_restart_s": [round(t, 1) for t in restarts],
        "router": {"replays": _counter_total(metrics, "pdserve_router_replays_total"),
                   "node_failures": _counter_total(metrics,
                                                   "pdserve_router_node_failures_total")},
        "rss": rss,
        "etcd_db": {**etcd, "second_half_growth": grew, "flat": etcd_flat},
        "fatal": fatal,
    }
    report["passed"] = (not failed and not mismatched and not drift_bad and etcd_flat
                        and not unrecovered and not fatal)
    return report


def markdown(report: dict) -> str:
    o, q = report["options"], report["requests"]
    lines = [f"# Soak: {o['minutes']} min, seed {o['seed']}, model {o['model']}, "
             f"{o['prefill']}P{o['decode']}D, concurrency {o['concurrency']}", "",
             f"**{'PASSED' if report['passed'] else 'FAILED'}** in {report['seconds']} s "
             f"(load average at the end {report['loadavg_end']})", "",
             f"- requests: {q['total']} ({', '.join(f'{k} {v}' for k, v in q['by_via'].items())})",
             f"- failed: **{q['failed']}**, texts differing from the single-node run: "
             f"**{q['mismatched']}**",
             f"- latency p50 / p99 / max: {q['latency_s']['p50']} / {q['latency_s']['p99']} / "
             f"{q['latency_s']['max']} s; longest wait for a next token: {q['stall_s']['max']} s",
             f"- router: {report['router']['replays']:.0f} replays, "
             f"{report['router']['node_failures']:.0f} node failures; supervisor restarts "
             f"(died -> ready): {report['supervisor_restart_s']}", ""]
    for err in q["errors"] + q["mismatches"]:
        lines.append(f"    {err}")
    lines += ["## Faults", "", "| t (s) | fault | target | detail | serving again after (s) |",
              "|---|---|---|---|---|"]
    for f in report["faults"]:
        after = f["recovered_after"] if f["recovered_after"] is not None else f"**{f['error']}**"
        lines.append(f"| {f['at']} | {f['kind']} | {f['target']} | {f['detail']} | {after} |")
    lines += ["", f"## RSS per process (baseline {o['warmup_s']:.0f} s after it appeared; "
              f"limit +{o['rss_limit']:.0%})", "",
              "| process | pid | seen (s) | first MB | baseline MB | end (s) | end MB | max MB "
              "| drift |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(report["rss"], key=lambda r: (r["process"], r["born_s"])):
        drift = f"{r['drift']:+.1%}" if "drift" in r else "(too short)"
        if r.get("within") is False:
            drift = f"**{drift}**"
        lines.append(f"| {r['process']} | {r['pid']} | {r['born_s']} | {r['first_mb']} | "
                     f"{r.get('baseline_mb', '-')} | {r['end_s']} | {r['end_mb']} | "
                     f"{r['max_mb']} | {drift} |")
    e = report["etcd_db"]
    if e.get("baseline"):
        mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
        lines += ["", "## etcd database", "",
                  f"- file: {mb(e['first'].get('total', 0))} at the start, "
                  f"{mb(e['baseline'].get('total', 0))} at warm-up ({e['baseline_s']} s), "
                  f"{mb(e['end'].get('total', 0))} at the end (in use "
                  f"{mb(e['end'].get('in_use', 0))}; revision {e['end'].get('revision')}, "
                  f"compacted up to {e['end'].get('compacted')})",
                  f"- largest in the first / second half after warm-up: "
                  f"{mb(e['max_first_half'])} / {mb(e['max_second_half'])}: "
                  f"{'flat' if e['flat'] else '**still growing**'}",
                  "- per minute (s: file MB, revision, compacted): " + ", ".join(
                      f"{t:.0f}: {mb(s.get('total', 0))[:-3]}, {s.get('revision')}, "
                      f"{s.get('compacted')}" for t, s in e["per_minute"])]
    if report["fatal"]:
        lines += ["", "## Fatal", ""] + [f"    {x}" for x in report["fatal"]]
    return "\n".join(lines) + "\n"


def write_reports(report: dict, out: Path) -> None:
    (out / "soak.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "soak.md").write_text(markdown(report))
