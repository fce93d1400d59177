"""bench/serve.py's results: one row per (system, load shape) out of the result JSON that
`vllm bench serve --save-result` writes, the markdown tables (every row; each pdserve
system against the best vLLM setup at the same shape) and the plots (output throughput
against TTFT p99 and against ITL p99, one curve per system). Pure functions over plain
dicts, so the tests feed them result files of a real run.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import md_table

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 99)


def result_row(system: str, shape: dict, result: dict) -> dict:
    """One table row from vLLM's result JSON (`--percentile-metrics ttft,tpot,itl,e2el
    --metric-percentiles 50,99`). Times in ms, as vLLM reports them; a latency vLLM did not
    report (no request completed) is None."""
    row = {"system": system, "shape": shape["name"], "input_len": shape["input_len"],
           "output_len": shape["output_len"], "concurrency": shape.get("concurrency"),
           "rate": shape.get("rate"), "num_prompts": result.get("num_prompts"),
           "completed": result.get("completed", 0), "failed": result.get("failed", 0),
           "duration_s": result.get("duration"),
           "output_tok_s": result.get("output_throughput"),
           "output_tokens": result.get("total_output_tokens"),
           "request_s": result.get("request_throughput")}
    for m in METRICS:
        for p in PERCENTILES:
            row[f"{m}_p{p}_ms"] = result.get(f"p{p}_{m}_ms")
    # --ignore-eos: every completed request must stream its full output length; a system
    # that stopped early would be timed on less work, so its row counts as an error
    want = row["completed"] * shape["output_len"]
    if row["output_tokens"] is not None and row["output_tokens"] != want:
        row["error"] = (f"returned {row['output_tokens']} output tokens, {want} asked "
                        f"({row['completed']} x {shape['output_len']})")
    return row


def error_row(system: str, shape: dict, error: str) -> dict:
    """A shape that produced no result file (the load generator or the server failed)."""
    return {"system": system, "shape": shape["name"], "input_len": shape["input_len"],
            "output_len": shape["output_len"], "concurrency": shape.get("concurrency"),
            "rate": shape.get("rate"), "num_prompts": shape.get("num_prompts"),
            "completed": 0, "failed": shape.get("num_prompts"), "error": error}


def load_label(row: dict) -> str:
    if row.get("rate") is not None:
        return f"{row['rate']:g} req/s"
    return f"c={row['concurrency']}"


def ms(v) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _ok(row: dict) -> bool:
    return not row.get("error") and bool(row.get("completed")) and \
        row.get("output_tok_s") is not None


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (system, shape) over a sweep's passes: the run of median output tok/s
    among the passes that completed (an even count takes the slower of the middle two),
    with all of that run's figures (latencies are not mixed across runs); failures summed,
    the passes' tok/s kept in `passes_tok_s`. Rows without a pass are returned as they
    are."""
    if not any("pass" in r for r in rows):
        return rows
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["shape"]), []).append(r)
    out = []
    for runs in groups.values():
        ok = [r for r in runs if _ok(r)]
        if not ok:
            out.append({**runs[0], "failed": sum(r.get("failed") or 0 for r in runs),
                        "passes": len(runs)})
            continue
        ok.sort(key=lambda r: r["output_tok_s"])
        row = dict(ok[(len(ok) - 1) // 2])      # a real run's figures, all of them
        row.update(failed=sum(r.get("failed") or 0 for r in runs), passes=len(runs),
                   passes_tok_s=[r["output_tok_s"] for r in runs if _ok(r)])
        row.pop("pass", None)
        out.append(row)
    return out


def rows_table(rows: list[dict]) -> str:
    header = ["system", "shape", "in/out", "load", "output tok/s"]
    header += [f"{m.upper()} p50/p99 ms" for m in METRICS] + ["failed"]
    out = []
    for r in rows:
        name = r["system"] + (f" (pass {r['pass']})" if "pass" in r else "")
        cells = [name, r["shape"], f"{r['input_len']}/{r['output_len']}", load_label(r)]
        if not _ok(r):
            out.append(cells + ["-"] * (1 + len(METRICS)) +
                       [f"{r.get('failed')} ({r.get('error') or 'no request completed'})"])
            continue
        cells.append(f"{r['output_tok_s']:.1f}")
        cells += [f"{ms(r[f'{m}_p50_ms'])} / {ms(r[f'{m}_p99_ms'])}" for m in METRICS]
        out.append(cells + [str(r["failed"])])
    return md_table(header, out)


def best_vllm(rows: list[dict]) -> dict[str, dict]:
    """shape -> the vLLM row (of any vLLM setup) with the highest output tok/s there."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["system"].startswith("vllm") and _ok(r):
            if r["shape"] not in best or r["output_tok_s"] > best[r["shape"]]["output_tok_s"]:
                best[r["shape"]] = r
    return best


def _ratio(a, b) -> float | None:
    return None if a is None or not b else a / b


def ratios(rows: list[dict]) -> list[dict]:
    """Each pdserve row against the best vLLM setup at its shape: output tok/s ours/vLLM
    (> 1: ours is faster) and TTFT p99 / ITL p99 ours/vLLM (< 1: ours is faster)."""
    best = best_vllm(rows)
    out = []
    for r in rows:
        peer = best.get(r["shape"])
        if r["system"].startswith("vllm") or peer is None or not _ok(r):
            continue
        out.append({"system": r["system"], "shape": r["shape"], "load": load_label(r),
                    "vllm": peer["system"], "output_tok_s": r["output_tok_s"],
                    "vllm_output_tok_s": peer["output_tok_s"],
                    "tok_s_ratio": _ratio(r["output_tok_s"], peer["output_tok_s"]),
                    "ttft_p99_ratio": _ratio(r["ttft_p99_ms"], peer["ttft_p99_ms"]),
                    "itl_p99_ratio": _ratio(r["itl_p99_ms"], peer["itl_p99_ms"])})
    return out


def ratios_table(ratio_rows: list[dict]) -> str:
    def x(v):
        return "-" if v is None else f"{v:.2f}x"
    return md_table(["system", "shape", "load", "best vLLM", "tok/s ours / vLLM",
                     "tok/s ratio", "TTFT p99 ratio", "ITL p99 ratio"],
                    [[r["system"], r["shape"], r["load"], r["vllm"],
                      f"{r['output_tok_s']:.1f} / {r['vllm_output_tok_s']:.1f}",
                      x(r["tok_s_ratio"]), x(r["ttft_p99_ratio"]), x(r["itl_p99_ratio"])]
                     for r in ratio_rows])


def pinned_summary(rows: list[dict], shape: str = "long") -> str | None:
    """--pin: decode ITL p99 of the pinned PD cluster (and the unpinned one, if run)
    against the best vLLM setup under the long-prompt mix."""
    at = {r["system"]: r for r in rows if r["shape"] == shape and _ok(r)}
    peer = best_vllm(rows).get(shape)
    if "pd-pinned" not in at or peer is None:
        return None
    parts = [f"ITL p99 under `{shape}`: pd-pinned {ms(at['pd-pinned']['itl_p99_ms'])} ms"]
    if "pd" in at:
        parts.append(f"pd (unpinned) {ms(at['pd']['itl_p99_ms'])} ms")
    parts.append(f"{peer['system']} {ms(peer['itl_p99_ms'])} ms")
    return ", ".join(parts)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """throughput_vs_ttft_p99.png and throughput_vs_itl_p99.png: per system, a curve through
    its concurrency sweep (annotated c=N) and open markers for its request-rate shapes; the
    long-prompt shape and failed shapes are left out (a different load, or no point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    sweep_len = None
    for r in rows:
        if r.get("concurrency") is not None and r.get("rate") is None and r["shape"] != "long":
            sweep_len = (r["input_len"], r["output_len"])
            break
    systems = list(dict.fromkeys(r["system"] for r in rows))
    paths = []
    for metric, label in (("ttft", "TTFT"), ("itl", "ITL")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, system in enumerate(systems):
            color = f"C{i % 10}"
            mine = [r for r in rows if r["system"] == system and _ok(r)
                    and (r["input_len"], r["output_len"]) == sweep_len
                    and r.get(f"{metric}_p99_ms") is not None]
            curve = sorted((r for r in mine if r.get("rate") is None),
                           key=lambda r: r["concurrency"])
            if curve:
                ax.plot([r["output_tok_s"] for r in curve],
                        [r[f"{metric}_p99_ms"] for r in curve], "o-", color=color, label=system)
                for r in curve:
                    ax.annotate(f"c={r['concurrency']}", (r["output_tok_s"], r[f"{metric}_p99_ms"]),
                                textcoords="offset points", xytext=(4, 4), fontsize=7,
                                color=color)
            rated = [r for r in mine if r.get("rate") is not None]
            if rated:
                ax.plot([r["output_tok_s"] for r in rated], [r[f"{metric}_p99_ms"] for r in rated],
                        "s", mfc="none", color=color, label=None if curve else system)
                for r in rated:
                    ax.annotate(f"{r['rate']:g}/s", (r["output_tok_s"], r[f"{metric}_p99_ms"]),
                                textcoords="offset points", xytext=(4, -10), fontsize=7,
                                color=color)
        ax.set_yscale("log")
        # labels at 1-2-5 steps (a narrow range gets more than one), 200 not 2 x 10^2
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{label} p99 (ms, log)")
        shape_text = f"{sweep_len[0]} in / {sweep_len[1]} out" if sweep_len else ""
        ax.set_title(f"Output throughput vs {label} p99 ({shape_text}; squares: request rate)",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / f"throughput_vs_{metric}_p99.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
