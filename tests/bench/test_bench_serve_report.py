"""bench/serve.py's pure parts: rows out of `vllm bench serve` result files, the best vLLM
setup per shape, the pdserve / vLLM ratios, the tables, the plots and the run plan. The
result files are those of a real `bench/serve.py --quick` run (per-request latency lists
dropped)."""

import argparse
import json
from pathlib import Path

import pytest

from bench import serve_report as report
from bench import vllm_setups
from bench.serve import all_shapes, plan

DATA = json.loads((Path(__file__).parent / "data" / "vllm_bench_serve_quick.json").read_text())
SHAPES = {name: {"name": name, "input_len": 64, "output_len": 32, "concurrency": c,
                 "rate": None, "num_prompts": 8} for name, c in (("c1", 1), ("c4", 4))}


def quick_rows() -> list[dict]:
    return [report.result_row(system, SHAPES[shape], DATA[system][shape])
            for system in ("pd", "aggregated", "vllm-default", "vllm-2t")
            for shape in ("c1", "c4")]


def test_result_row_takes_vllms_fields():
    row = report.result_row("pd", SHAPES["c4"], DATA["pd"]["c4"])
    assert row["completed"] == 8 and row["failed"] == 0 and row["num_prompts"] == 8
    assert row["concurrency"] == 4 and row["rate"] is None
    assert row["output_tok_s"] == pytest.approx(38.5517, abs=1e-3)
    assert row["ttft_p50_ms"] == pytest.approx(843.7416, abs=1e-3)
    assert row["ttft_p99_ms"] == pytest.approx(947.5483, abs=1e-3)
    assert row["itl_p99_ms"] == pytest.approx(133.2423, abs=1e-3)
    assert row["tpot_p50_ms"] == pytest.approx(77.2537, abs=1e-3)
    assert row["e2el_p99_ms"] == pytest.approx(3335.3518, abs=1e-3)


def test_best_vllm_is_the_faster_setup_per_shape():
    best = report.best_vllm(quick_rows())
    assert {shape: r["system"] for shape, r in best.items()} == {
        "c1": "vllm-default", "c4": "vllm-default"}
    # a vLLM setup that failed at a shape is never the reference there
    rows = [r if (r["system"], r["shape"]) != ("vllm-default", "c4")
            else report.error_row("vllm-default", SHAPES["c4"], "server did not start")
            for r in quick_rows()]
    assert report.best_vllm(rows)["c4"]["system"] == "vllm-2t"


def test_ratios_against_the_best_vllm():
    by = {(r["system"], r["shape"]): r for r in report.ratios(quick_rows())}
    assert set(by) == {("pd", "c1"), ("pd", "c4"), ("aggregated", "c1"), ("aggregated", "c4")}
    pd4 = by[("pd", "c4")]
    assert pd4["vllm"] == "vllm-default"
    assert pd4["tok_s_ratio"] == pytest.approx(38.5517 / 45.2021, rel=1e-4)
    assert pd4["ttft_p99_ratio"] == pytest.approx(947.5483 / 859.5785, rel=1e-4)
    assert pd4["itl_p99_ratio"] == pytest.approx(133.2423 / 83.9726, rel=1e-4)


def test_failed_pdserve_rows_get_no_ratio_but_stay_in_the_table():
    rows = quick_rows()
    rows[0] = report.error_row("pd", SHAPES["c1"], "load generator exited early")
    assert ("pd", "c1") not in {(r["system"], r["shape"]) for r in report.ratios(rows)}
    table = report.rows_table(rows)
    assert "| pd | c1 | 64/32 | c=1 | - |" in table
    assert "8 (load generator exited early)" in table
    assert "| pd | c4 | 64/32 | c=4 | 38.6 | 844 / 948 | 77.3 / 79.4 | 76.9 / 133 |" in table


def test_ratio_table_and_pinned_summary():
    text = report.ratios_table(report.ratios(quick_rows()))
    assert "| pd | c4 | c=4 | vllm-default | 38.6 / 45.2 | 0.85x | 1.10x | 1.59x |" in text
    long_shape = {**SHAPES["c4"], "name": "long"}
    rows = [report.result_row(s, long_shape, DATA[d]["c4"])
            for s, d in (("pd-pinned", "pd"), ("pd", "aggregated"), ("vllm-2t", "vllm-2t"))]
    assert report.pinned_summary(rows) == ("ITL p99 under `long`: pd-pinned 133 ms, "
                                           "pd (unpinned) 262 ms, vllm-2t 258 ms")
    assert report.pinned_summary(quick_rows()) is None


def test_plots_are_written(tmp_path):
    paths = report.plot(quick_rows(), tmp_path)
    assert [p.name for p in paths] == ["throughput_vs_ttft_p99.png",
                                       "throughput_vs_itl_p99.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _args(**kw):
    base = {"systems": None, "shapes": None, "quick": False, "pin": False}
    return argparse.Namespace(**{**base, **kw})


def test_plan_expands_vllm_and_pin_adds_the_long_shape(monkeypatch):
    monkeypatch.setattr(vllm_setups, "missing", lambda name: None)
    work = {s.name: [sh.name for sh in shapes] for s, shapes in plan(_args(
        systems="pd,vllm", shapes="c1,c4", pin=True))}
    assert work == {"pd": ["c1", "c4", "long"], "vllm-2t": ["c1", "c4", "long"],
                    "vllm-default": ["c1", "c4", "long"], "vllm-tuned": ["c1", "c4", "long"],
                    "pd-pinned": ["long"]}
    quick = {s.name: [sh.name for sh in shapes] for s, shapes in plan(_args(quick=True))}
    assert quick == {n: ["c1", "c4"] for n in ("pd", "aggregated", "vllm-2t", "vllm-default",
                                               "vllm-tuned")}
    with pytest.raises(SystemExit):
        plan(_args(systems="sglang"))


def test_a_vllm_setup_without_its_libraries_is_left_out_and_said(monkeypatch, capsys):
    monkeypatch.setattr(vllm_setups, "missing",
                        lambda name: "missing libiomp5.so" if name == "vllm-tuned" else None)
    work = [s.name for s, _ in plan(_args(systems="vllm", shapes="c1"))]
    assert work == ["vllm-2t", "vllm-default"]
    assert "vllm-tuned not run: missing libiomp5.so" in capsys.readouterr().out


def test_vllm_tuned_preloads_tcmalloc_and_intel_openmp(monkeypatch, tmp_path):
    tc, iomp = tmp_path / "libtcmalloc_minimal.so.4", tmp_path / "libiomp5.so"
    monkeypatch.setattr(vllm_setups, "tcmalloc", lambda: tc)
    monkeypatch.setattr(vllm_setups, "iomp", lambda: iomp)
    env = vllm_setups.env("vllm-tuned", 2)
    assert env["LD_PRELOAD"] == f"{tc}:{iomp}"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    monkeypatch.setattr(vllm_setups, "iomp", lambda: None)
    assert "intel-openmp" in vllm_setups.missing("vllm-tuned")
    with pytest.raises(RuntimeError, match="make bench-peer"):
        vllm_setups.env("vllm-tuned", 2)


def test_passes_reduce_to_their_median_run():
    base = quick_rows()[0]
    runs = [{**base, "pass": p, "output_tok_s": tok, "ttft_p99_ms": ttft,
             "phases_ms": {"prefill": tok}}
            for p, tok, ttft in ((1, 300.0, 900.0), (2, 100.0, 500.0), (3, 200.0, 700.0))]
    (row,) = report.median_rows(runs)
    assert row["output_tok_s"] == 200.0 and row["ttft_p99_ms"] == 700.0
    assert row["phases_ms"] == {"prefill": 200.0}       # the median run's own
    assert row["passes"] == 3 and sorted(row["passes_tok_s"]) == [100.0, 200.0, 300.0]
    assert "pass" not in row
    failed = {**base, "pass": 4, "error": "server did not start", "failed": 4}
    (row,) = report.median_rows(runs[:2] + [failed])
    assert row["output_tok_s"] == 100.0 and row["failed"] == base["failed"] * 2 + 4


def test_default_shapes_scale_prompts_with_concurrency():
    shapes = all_shapes(quick=False)
    assert [(s.concurrency, s.num_prompts) for s in
            (shapes["c1"], shapes["c4"], shapes["c16"], shapes["c64"])] == [
        (1, 4), (4, 8), (16, 32), (64, 64)]
    assert (shapes["long"].input_len, shapes["long"].concurrency) == (1024, 16)
    assert (shapes["r4"].rate, shapes["r4"].num_prompts) == (4.0, 16)
    assert shapes["r4"].concurrency is None


def test_a_run_that_streamed_fewer_tokens_than_asked_is_an_error():
    shape = {"name": "c1", "input_len": 256, "output_len": 128, "concurrency": 1}
    full = report.result_row("pd", shape, {"completed": 4, "total_output_tokens": 512,
                                           "output_throughput": 90.0})
    assert "error" not in full
    short = report.result_row("pd", shape, {"completed": 4, "total_output_tokens": 500,
                                            "output_throughput": 95.0})
    assert "returned 500 output tokens, 512 asked" in short["error"]
    assert report.ratios([short, {**full, "system": "vllm-2t"}]) == []
