"""pdserve served over HTTP against `vllm serve`, both loaded by vLLM's own serving
benchmark (`vllm bench serve`, from the peer venv of `make bench-peer`):

    make bench-serve                           # or: .venv/bin/python -m bench.serve
    .venv/bin/python -m bench.serve --quick    # a few-minute smoke of the plumbing
        [--systems pd,pd-mtp,pd-graph,aggregated,vllm] [--shapes c1,c4,c16,c64,r1,r4,long]
        [--pin] [--dtype float32] [--model DIR] [--out DIR]

Systems (each started fresh, waited for until /health is 200, loaded, stopped):
  pd            pdserve up, 1 prefill + 1 decode node
  pd-mtp        the same with MTP speculative decoding (--speculative-method mtp, k=1)
  pd-graph      the same with --enable-graph (on CPU the graph path pads and binds the
                batch into persistent buffers and "replays" by rerunning the forward)
  aggregated    pdserve up --aggregated (one node prefills and decodes)
  vllm          vllm serve on the same folder (without pdserve's mtp*.safetensors), in each
                setup of bench/vllm_setups.py: vllm-default (vLLM's CPU default: a core
                reserved), vllm-2t (every core for compute) and vllm-tuned (vllm-2t with
                TCMalloc and Intel OpenMP preloaded, as vLLM's CPU docs recommend); the
                ratio table takes the best one at each shape
  pd-pinned     (--pin) PD with the prefill node on CPU 0 and the decode node on CPU 1;
                runs the long-prompt shape only, which --pin adds for every system
Same dtype, batch cap (--max-num-seqs) and KV cache size (--kv-gb) on both sides.

Shapes (random prompts, seed 0, identical for every system; --ignore-eos):
  c1 c4 c16 c64   256 in / 128 out at that many concurrent requests; 4, 8, 32, 64 prompts
                  (two waves up to c=16, one at c=64)
  r1 r4           256 in / 128 out arriving at 1 and 4 requests/s (Poisson), 8 and 16
                  prompts, no concurrency cap
  long            1024 in / 128 out at concurrency 16, 16 prompts
--quick: c1 and c4 with 8 prompts of 64 in / 32 out, systems pd, aggregated, vllm.

Writes into --out: serve.md (the tables), serve.json (rows + settings), the two plots, and
results/ (vLLM's result file per system and shape) and logs/ (server and client logs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import serve_cpu, vllm_setups
from bench import serve_phases as phases
from bench import serve_report as report
from bench.serve_systems import PEER_PYTHON, ROOT, Server, Settings, System, all_systems

DEFAULT_SYSTEMS = "pd,pd-mtp,pd-graph,aggregated,vllm"
QUICK_SYSTEMS = "pd,aggregated,vllm"
# Rough costs on the 2-core development box (float32, SmolLM2-135M; pd measured 15 tok/s at
# c=1, 51 at c=16, 76 at c=64 while another job took about a core; these assume a little
# better), only for the up-front estimate and the time-left figure, which rescales itself
# by how the estimate held up so far.
STARTUP_S = {"pdserve": 30.0, "vllm": 120.0}
CLIENT_START_S, STOP_S = 15.0, 10.0
PREFILL_TOK_S, DECODE_TOK_S_ONE, DECODE_SCALING = 1500.0, 22.0, 0.4


@dataclass(frozen=True)
class Shape:
    name: str
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int | None = None
    rate: float | None = None


def all_shapes(quick: bool) -> dict[str, Shape]:
    if quick:
        return {"c1": Shape("c1", 64, 32, 8, concurrency=1),
                "c4": Shape("c4", 64, 32, 8, concurrency=4),
                "r1": Shape("r1", 64, 32, 8, rate=1.0),
                "r4": Shape("r4", 64, 32, 8, rate=4.0),
                "long": Shape("long", 512, 32, 8, concurrency=4)}
    # Prompt counts keep the default sweep at 35-45 minutes for six servers on 2 cores
    # (pd decodes ~15-80 tok/s there): two waves of requests up to c=16, one at c=64.
    shapes = {f"c{c}": Shape(f"c{c}", 256, 128, max(4, min(2 * c, 64)), concurrency=c)
              for c in (1, 4, 16, 64)}
    shapes.update({f"r{r}": Shape(f"r{r}", 256, 128, n, rate=float(r))
                   for r, n in ((1, 8), (4, 16))})
    shapes["long"] = Shape("long", 1024, 128, 16, concurrency=16)
    return shapes


def estimate_s(shape: Shape) -> float:
    # requests in flight: the concurrency, or for a rate what piles up at these speeds
    width = min(shape.num_prompts, shape.concurrency or 4 * shape.rate + 4)
    decode = shape.num_prompts * shape.output_len / (DECODE_TOK_S_ONE *
                                                     width ** DECODE_SCALING)
    busy = shape.num_prompts * shape.input_len / PREFILL_TOK_S + decode
    arrivals = shape.num_prompts / shape.rate if shape.rate else 0.0
    return max(busy, arrivals) + 3.0


def warmup_s(shape: Shape) -> float:
    """The two untimed requests before a server's first shape."""
    return estimate_s(Shape("warmup", shape.input_len, shape.output_len, 2, concurrency=2))


def plan(args) -> list[tuple[System, list[Shape]]]:
    systems = all_systems(os.cpu_count() or 1)
    shapes = all_shapes(args.quick)
    names = []
    for name in (args.systems or (QUICK_SYSTEMS if args.quick else DEFAULT_SYSTEMS)).split(","):
        if name == "vllm":
            for setup in vllm_setups.NAMES:
                if vllm_setups.missing(setup):
                    print(f"{setup} not run: {vllm_setups.missing(setup)}")
                else:
                    names.append(setup)
        else:
            names.append(name)
    chosen = args.shapes.split(",") if args.shapes else (
        ["c1", "c4"] if args.quick else ["c1", "c4", "c16", "c64", "r1", "r4", "long"])
    if args.pin:
        chosen += [] if "long" in chosen else ["long"]
        names += [] if "pd-pinned" in names else ["pd-pinned"]
    for n in names:
        if n not in systems:
            raise SystemExit(f"unknown system {n!r}; known: {', '.join(systems)}, vllm")
    for s in chosen:
        if s not in shapes:
            raise SystemExit(f"unknown shape {s!r}; known: {', '.join(shapes)}")
    return [(systems[n], [shapes[s] for s in chosen if n != "pd-pinned" or s == "long"])
            for n in dict.fromkeys(names)]


def client_argv(shape: Shape, system: System, url: str, s: Settings, results: Path,
                first: bool, tag: str = "") -> list:
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", s.served_name, "--tokenizer", s.plain_model, "--dataset-name", "random",
            "--random-input-len", str(shape.input_len),
            "--random-output-len", str(shape.output_len), "--ignore-eos",
            "--num-prompts", str(shape.num_prompts), "--seed", "0",
            # greedy on both sides (the servers' defaults differ); the same work either way
            "--temperature", "0",
            # two untimed requests on a fresh server: first-request costs (lazy kernel
            # builds, allocator growth) are not what a served load is about; later shapes
            # find it warm
            "--num-warmups", "2" if first else "0", "--disable-tqdm", "--label", system.name,
            # --save-detailed: per-request TTFTs and ITLs in the result file, for analysis
            "--save-result", "--save-detailed", "--result-dir", str(results),
            "--result-filename", f"{system.name}{tag}__{shape.name}.json",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    if shape.concurrency:
        argv += ["--max-concurrency", str(shape.concurrency)]
    if shape.rate:
        argv += ["--request-rate", f"{shape.rate:g}"]
    return argv


class Progress:
    def __init__(self, total_s: float, total_runs: int):
        self.t0, self.total_s, self.done_s = time.monotonic(), total_s, 0.0
        self.total_runs, self.runs = total_runs, 0

    def credit(self, estimated_s: float) -> None:
        self.done_s += estimated_s

    def line(self, text: str) -> str:
        elapsed = time.monotonic() - self.t0
        # what is left, scaled by how the estimate has held up so far
        scale = elapsed / self.done_s if self.done_s > 60 else 1.0
        left = max(0.0, self.total_s - self.done_s) * scale
        return (f"[{self.runs}/{self.total_runs} {_mmss(elapsed)} elapsed, ~{_mmss(left)} "
                f"left] {text}")


def _mmss(s: float) -> str:
    return f"{int(s // 60)}:{int(s % 60):02d}"


def run_system(system: System, shapes: list[Shape], s: Settings, out: Path,
               progress: Progress, tag: str = "") -> tuple[list[dict], dict]:
    """tag: added to the system's file names (the pass of a repeated sweep)."""
    results, logs = out / "results", out / "logs"
    shape_dicts = [asdict(sh) for sh in shapes]
    info: dict = {"what": system.what}
    server = Server(system, s, logs / f"{system.name}{tag}-server.log")
    print(progress.line(f"starting {system.name}: {system.what}"), flush=True)
    rows: dict[int, dict] = {}
    try:
        server.start()
        info["command"] = " ".join(server.command)
        try:
            info["ready_s"] = round(server.wait_healthy(900.0 if system.kind == "vllm"
                                                        else 600.0), 1)
        except RuntimeError as exc:
            print(f"   {system.name} did not come up: {str(exc).splitlines()[0]}", flush=True)
            info["error"] = str(exc)[:4000]
            return [report.error_row(system.name, d, "server did not start")
                    for d in shape_dicts], info
        progress.credit(STARTUP_S[system.kind] + warmup_s(shapes[0]))
        print(progress.line(f"{system.name} serving after {info['ready_s']} s"), flush=True)
        runs_file = logs / f"{system.name}{tag}-runs.json"
        runs_file.write_text(json.dumps([{"key": f"{system.name}/{sh.name}",
                                          "argv": client_argv(sh, system, server.url, s, results,
                                                              first=i == 0, tag=tag)}
                                         for i, sh in enumerate(shapes)], indent=1))
        scraped = None          # the router's phase histogram at the start of a shape
        cpu_before: dict = {}   # CPU seconds per process at the start of a shape
        with open(logs / f"{system.name}{tag}-client.log", "w") as log:
            client = subprocess.Popen([str(PEER_PYTHON), str(ROOT / "bench" / "serve_client.py"),
                                       str(runs_file)], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            for line in client.stdout:
                log.write(line)
                if not line.startswith("@@"):
                    continue
                word, index, rest = (line.strip().split(" ", 2) + [""])[:3]
                sh, d = shapes[int(index)], shape_dicts[int(index)]
                label = f"{system.name} {sh.name} ({sh.input_len}/{sh.output_len}, " \
                        f"{report.load_label(d)}, {sh.num_prompts} prompts)"
                if word == "@@start":
                    if system.kind == "pdserve":
                        scraped = phases.scrape(server.url)
                    cpu_before = serve_cpu.snapshot(server.proc.pid, client.pid)
                    progress.runs += 1
                    print(progress.line(label + " ..."), flush=True)
                    continue
                progress.credit(estimate_s(sh))
                if word == "@@done":
                    cpu_s = serve_cpu.used(cpu_before,
                                           serve_cpu.snapshot(server.proc.pid, client.pid))
                    path = results / f"{system.name}{tag}__{sh.name}.json"
                    row = report.result_row(system.name, d, json.loads(path.read_text()))
                    if system.kind == "pdserve":
                        row["phases_ms"] = phases.mean_ms(scraped, phases.scrape(server.url))
                    row["cpu_s"] = cpu_s
                    rows[int(index)] = row
                    print(f"   {row['output_tok_s']:.1f} tok/s, TTFT p99 "
                          f"{report.ms(row['ttft_p99_ms'])} ms, ITL p99 "
                          f"{report.ms(row['itl_p99_ms'])} ms, failed {row['failed']}",
                          flush=True)
                else:
                    rows[int(index)] = report.error_row(system.name, d, rest[:200])
                    print(f"   failed: {rest[:200]}", flush=True)
            client.wait()
        if server.proc.poll() is not None:
            info["error"] = f"server exited ({server.proc.returncode}) during the load"
    finally:
        forced = server.stop()
        progress.credit(STOP_S + CLIENT_START_S)
        if forced:
            info["forced_kill_pids"] = forced
            print(f"   {system.name} did not stop cleanly: killed {forced}", flush=True)
    return [rows.get(i) or report.error_row(system.name, d, "load generator exited early")
            for i, d in enumerate(shape_dicts)], info


def write_outputs(out: Path, meta: dict, rows: list[dict], infos: dict) -> str:
    medians = report.median_rows(rows)
    ratio_rows = report.ratios(medians)
    text = ["# bench/serve.py", "", f"CPU: {meta['cpu_line']}",
            f"pdserve's kernels chosen by measurement: {meta['kernels_line']}", ""]
    if medians is not rows:
        text += [f"Median of {meta['repeats']} passes (the order of systems rotated each "
                 "pass):", "", report.rows_table(medians), ""]
    if ratio_rows:
        text += ["pdserve / best vLLM setup at each shape, on the medians (tok/s: > 1 is "
                 "faster; TTFT and ITL p99: < 1 is faster):", "",
                 report.ratios_table(ratio_rows), ""]
    text += ["Every run:", "", report.rows_table(rows), ""]
    labelled = [{**r, "system": f"{r['system']} (pass {r['pass']})"} if "pass" in r else r
                for r in rows]
    phase_text = phases.phases_table(labelled)
    if phase_text:
        text += ["pdserve: mean time of each phase before the first token, from the router's "
                 "pdserve_router_request_phase_seconds over each shape (bench/serve_phases.py):",
                 "", phase_text, ""]
    cpu_text = serve_cpu.cpu_table(labelled)
    if cpu_text:
        text += ["CPU seconds per 1,000 output tokens by process over each shape, from /proc "
                 "(bench/serve_cpu.py; 2 cores give 2 CPU-s per second):", "", cpu_text, ""]
    pinned = report.pinned_summary(medians)
    if pinned:
        text += [pinned, ""]
    text += [f"{meta['model_name']}, {meta['dtype']}, max-num-seqs {meta['max_num_seqs']}, "
             f"KV {meta['kv_gb']:g} GB per engine, {meta['cpu']} x {meta['os_cpus']}, load "
             f"average {meta['loadavg_start']} at start, {meta['loadavg_end']} at end"]
    for name, info in infos.items():
        if info.get("ready_s") is not None:
            text.append(f"- {name}: /health 200 after {info['ready_s']} s")
        if info.get("error"):
            text.append(f"- {name}: {info['error'].splitlines()[0]}")
    md = "\n".join(text) + "\n"
    (out / "serve.md").write_text(md)
    (out / "serve.json").write_text(json.dumps({"meta": meta, "systems": infos, "rows": rows,
                                                "ratios": ratio_rows}, indent=2))
    for p in report.plot(rows, out):
        print(f"plot: {p}")
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--systems", default=None, help=f"default {DEFAULT_SYSTEMS} "
                    f"(--quick: {QUICK_SYSTEMS}); vllm = {','.join(vllm_setups.NAMES)}")
    ap.add_argument("--shapes", default=None, help="default c1,c4,c16,c64,r1,r4,long "
                    "(--quick: c1,c4)")
    ap.add_argument("--quick", action="store_true", help="a smoke: tiny shapes, few systems")
    ap.add_argument("--pin", action="store_true", help="add pd-pinned (prefill node on CPU 0, "
                    "decode node on CPU 1) and the long shape")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="both systems (float32: bf16 is emulated on an AVX2-only CPU)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-gb", type=float, default=2.0, help="KV cache per engine")
    ap.add_argument("--insecure", action="store_true", help="pdserve up --insecure "
                    "(default: its mutual TLS between router and nodes)")
    ap.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", default=None, help="default bench/results/serve-<timestamp>")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the systems, the "
                    "order rotated each pass (tables give the median pass; default 2)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and estimate only")
    args = ap.parse_args(argv)

    if not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} is missing: run `make bench-peer` first")
    work = plan(args)
    out = Path(args.out or ROOT / "bench" / "results" / time.strftime("serve-%Y%m%d-%H%M%S"))
    per_system = {sys_.name: STARTUP_S[sys_.kind] + CLIENT_START_S + STOP_S +
                  warmup_s(shapes[0]) + sum(estimate_s(sh) for sh in shapes)
                  for sys_, shapes in work}
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    total = sum(per_system.values()) * args.repeats
    print(f"bench/serve.py -> {out}\n{len(work)} systems x {args.repeats} passes (order "
          f"rotated each pass), {sum(len(s) for _, s in work) * args.repeats} runs, "
          f"rough estimate {_mmss(total)} (load average "
          f"{[round(x, 2) for x in os.getloadavg()]}):")
    for sys_, shapes in work:
        print(f"  {sys_.name:<13} {','.join(sh.name for sh in shapes):<28} "
              f"~{_mmss(per_system[sys_.name])}")
    if args.dry_run:
        return 0
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)

    from bench.common import machine_facts
    from bench.machine import cpu_line, cpu_record, kernels_line, model_kernels
    from bench.versus_vllm import _plain_model
    from router.model_info import ModelInfo

    model = args.model
    if model is None:
        from launch.default_model import prepare_default_model
        model = str(prepare_default_model(progress=True))
    plain = model if not any(Path(model).glob("mtp*.safetensors")) else (
        str(out / "model") if (out / "model").is_dir() else _plain_model(model, out))
    settings = Settings(model=model, plain_model=plain,
                        served_name=ModelInfo.from_folder(model).name, dtype=args.dtype,
                        max_num_seqs=args.max_num_seqs, kv_gb=args.kv_gb,
                        insecure=args.insecure)
    facts = machine_facts()
    meta = {"model": model, "model_name": settings.served_name, "dtype": args.dtype,
            "max_num_seqs": args.max_num_seqs, "kv_gb": args.kv_gb, "quick": args.quick,
            "cpu": facts["cpu"], "os_cpus": facts["os_cpus"], "torch": facts["torch"],
            "loadavg_start": facts["loadavg_at_start"], "argv": sys.argv[1:]}

    meta["machine"] = cpu_record()
    meta["kernels_chosen"] = model_kernels(model, args.dtype)
    meta["cpu_line"] = cpu_line(meta["machine"])
    meta["kernels_line"] = kernels_line(meta["kernels_chosen"])
    meta["repeats"] = args.repeats
    print(f"CPU: {meta['cpu_line']}\npdserve's kernels here: {meta['kernels_line']}",
          flush=True)
    progress = Progress(total, sum(len(s) for _, s in work) * args.repeats)
    rows, infos = [], {}
    for p in range(args.repeats):
        # a rotated order each pass: a drift of the machine's speed over the sweep does
        # not always land on the same system
        k = p % len(work)
        for sys_, shapes in work[k:] + work[:k]:
            tag = f"-p{p + 1}" if args.repeats > 1 else ""
            got, infos[sys_.name + tag] = run_system(sys_, shapes, settings, out, progress,
                                                     tag)
            rows += [{**r, "pass": p + 1} for r in got]
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["elapsed_s"] = round(time.monotonic() - progress.t0, 1)
    print("\n" + write_outputs(out, meta, rows, infos))
    print(f"written: {out}/serve.md, serve.json, throughput_vs_*_p99.png")
    return 0 if all(not r.get("error") and not r.get("failed") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
