"""One engine, one process, one workload: the child side of `bench/versus_vllm.py`.

    python bench/engine_runner.py --engine ours|vllm --spec SPEC.json --out OUT.json

Run by the project's venv for `ours` and by the peer venv (`make bench-peer`) for `vllm`,
so each engine gets a fresh process with only its own imports, as a user would run it.
It must not import the project when --engine vllm (the peer venv does not have it).

SPEC: {"model": folder, "dtype": "bfloat16", "max_model_len": int, "max_num_seqs": int,
       "kv_gb": KV cache GiB (vLLM takes it from VLLM_CPU_KVCACHE_SPACE, set by the parent),
       "workloads": {name: [{"prompt": [ids], "max_tokens": n, sampled workloads also
                              "temperature", "top_p", maybe "seed"}, ...], ...}}
OUT:  {"workloads": {name: {"tokens": [[ids], ...], "elapsed_s": wall seconds}},
       "ready_s": process start -> engine built, "first_output_s": process start -> the
       first output of a one-token warm-up request, "peak_rss_mb": the process's peak RSS,
       "tree_peak_rss_mb": the peaks of it and its live child processes, summed}
Greedy unless a request carries a temperature (and top_p, seed); ignore_eos: every request
produces exactly max_tokens tokens. The workloads run
one after another in the order given, after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()


def run_ours(spec: dict) -> tuple[callable, callable]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from engine import LLM, SamplingParams

    llm = LLM(spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], kv_cache_memory_gb=spec["kv_gb"])

    def generate(reqs: list[dict]) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in reqs],
                            [SamplingParams(**sampling(r)) for r in reqs])
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate


def run_vllm(spec: dict):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], seed=0)

    def generate(reqs: list[dict]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt"]) for r in reqs],
                            [SamplingParams(**sampling(r)) for r in reqs], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate


def sampling(req: dict) -> dict:
    """SamplingParams keywords both engines take: greedy unless the request says, always
    ignore_eos (every request produces exactly max_tokens)."""
    out = {"max_tokens": req["max_tokens"], "temperature": req.get("temperature", 0.0),
           "ignore_eos": True}
    out.update({k: req[k] for k in ("top_p", "seed") if k in req})
    return out


def tree_peak_rss_mb() -> float:
    """The sum of the peak RSS (VmHWM) of this process and every live descendant: vLLM runs
    its engine core in a child process, whose memory this process's own peak misses."""
    def children(pid: int) -> list[int]:
        out = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            text = (task / "children").read_text() if (task / "children").exists() else ""
            out += [int(c) for c in text.split()]
        return out

    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
            todo += children(pid)
        except OSError:          # it ended meanwhile
            continue
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["ours", "vllm"], required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    generate = (run_ours if args.engine == "ours" else run_vllm)(spec)
    ready_s = time.perf_counter() - STARTED
    first = next(iter(spec["workloads"].values()))[0]
    generate([{"prompt": first["prompt"][:8], "max_tokens": 1}])
    first_output_s = time.perf_counter() - STARTED
    results = {}
    for name, reqs in spec["workloads"].items():
        t = time.perf_counter()
        tokens = generate(reqs)
        results[name] = {"tokens": tokens, "elapsed_s": time.perf_counter() - t}
        print(f"{args.engine}: {name} {results[name]['elapsed_s']:.1f} s", flush=True)
    Path(args.out).write_text(json.dumps({
        "workloads": results, "ready_s": ready_s,
        "first_output_s": first_output_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tree_peak_rss_mb": tree_peak_rss_mb(), "kernels_chosen": kernels_chosen(args.engine)}))
    return 0


def kernels_chosen(engine: str) -> dict[str, str]:
    """pdserve's kernel choices for this model in this process (measured or kept)."""
    if engine != "ours":
        return {}
    from engine.layers.kernel_choice import CHOICES
    return CHOICES.made()


if __name__ == "__main__":
    sys.exit(main())
