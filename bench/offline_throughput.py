"""Offline throughput: pdserve's `LLM.generate` against HF transformers' batched `generate`,
in one process, on the same weights and the same requests; ratios are measured in the same
run, so they hold even when other processes share the CPUs.

    .venv/bin/python bench/offline_throughput.py [--quick] [--model DIR] [--dtype bfloat16]
        [--workloads mixed,uniform,short] [--models smollm2,random100m] [--hf-batch 16]
        [--json out.json]
    .venv/bin/python bench/offline_throughput.py --peer vllm [--rounds 2]   # vs vLLM CPU

Workloads (random token ids from a fixed seed, greedy, ignore_eos):
  mixed    64 requests, prompt lengths uniform in 32-512, output lengths uniform in 32-256.
           Ours gets them all at once (continuous batching, every request stops at its own
           length). HF cannot stop rows of one batch at different lengths, so it gets them
           sorted by prompt length and cut into batches of --hf-batch (16): little left
           padding; each batch generates to the longest output among its members, and only
           the tokens each request asked for count as useful output.
  short    48 requests, prompts 16-320, outputs 8-96: mixed's rules on short sequences,
           where per-step host cost shows.
  uniform  32 requests with 128-token prompts and 128 output tokens: one batch for HF, so
           no padding waste; greedy tokens of both are compared (count of identical ones;
           bf16 can differ slightly, so this reports and never fails).
Models: smollm2 (SmolLM2-135M-Instruct, the default model) and random100m (a random Llama,
hidden 768, 12 layers, 12 heads / 4 KV heads, intermediate 2048, vocab 32000; ~125M
parameters with the untied embedding, ~100M in matmuls), or --model DIR instead.

Also measured: our decode step at batch 32 (engine steps timed directly, decode-only ones)
against the machine's limit: the model's matmuls timed with torch.matmul on the model's
own shapes in nn.Linear's layout at that batch, plus the attention FLOPs at that rate; and
`build_forward_input` for 256 decode sequences, with and without a thread pool.
tokens/s everywhere means useful output tokens per second of wall time (prefill included).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    DTYPES,
    HFRunner,
    Request,
    agreement,
    linear_shapes,
    machine_facts,
    make_random_llama,
    matmul_calibration,
    matmul_params,
    md_table,
    naive_layout_gflops,
    random_requests,
)
from engine import LLM, SamplingParams  # noqa: E402
from engine.models.model_config import ModelConfig  # noqa: E402

FULL = {"mixed": (64, (32, 512), (32, 256)), "uniform": (32, 128, 128),
        "short": (48, (16, 320), (8, 96)),
        "decode": (32, 16, 64), "builder": (256, 200)}
QUICK = {"mixed": (8, (16, 64), (8, 32)), "uniform": (8, 32, 16),
         "short": (8, (8, 32), (4, 12)),
         "decode": (32, 8, 8), "builder": (256, 50)}


def params(r: Request) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)


def run_ours(llm: LLM, requests: list[Request], desc: str):
    """LLM.generate on all requests at once; a token progress bar rides on engine.step."""
    engine = llm.engine
    bar = tqdm(total=sum(r.max_tokens for r in requests), desc=desc, unit="tok")
    inner = engine.step

    def step():
        grew = inner()
        bar.update(len(grew))
        return grew

    engine.step = step
    before = dict(llm.stats())
    try:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r.prompt} for r in requests],
                            [params(r) for r in requests])
        elapsed = time.perf_counter() - start
    finally:
        del engine.step
        bar.close()
    after = llm.stats()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    steps = after["steps"] - before["steps"]
    return tokens, elapsed, {"steps": steps,
                             "preemptions": after["preemptions"] - before["preemptions"]}


def measure_decode_step(llm: LLM, cfg: ModelConfig, batch: int, prompt_len: int,
                        steps: int, seed: int) -> dict:
    """Time engine steps that are decode-only at `batch` sequences."""
    engine = llm.engine
    reqs = random_requests(batch, (prompt_len, prompt_len), (steps + 1, steps + 1),
                           cfg.vocab_size, seed)
    ids = [f"decode-bench-{seed}-{i}" for i in range(batch)]
    times, kv_tokens = [], []
    bar = tqdm(total=steps + 1, desc="decode steps", unit="step")
    try:
        for rid, r in zip(ids, reqs, strict=True):
            engine.add_request(rid, r.prompt, params(r))
        while engine.has_unfinished():
            c0 = engine.counters["computed_tokens"]
            t = time.perf_counter()
            grew = engine.step()
            dt = time.perf_counter() - t
            bar.update(1)
            if engine.counters["computed_tokens"] - c0 == batch == len(grew):
                times.append(dt)
                kv_tokens.append(sum(s.num_cached_tokens for s in grew))
    finally:
        bar.close()
        for rid in ids:
            engine.abort(rid)
            engine.release(rid)
    attn_flops = (4.0 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
                  * statistics.fmean(kv_tokens))
    return {"batch": batch, "steps_timed": len(times), "median_s": statistics.median(times),
            "min_s": min(times), "mean_kv_len": statistics.fmean(kv_tokens) / batch,
            "attn_flops": attn_flops,
            "matmul_flops": 2.0 * matmul_params(cfg) * batch}


def bench_builder(vocab: int, block_size: int, n_seqs: int, runs: int, seed: int) -> list:
    """build_forward_input for n_seqs decode sequences (lengths 64-1024), median ms."""
    from engine.input_builder import BatchInputBuilder
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence

    rng = random.Random(seed)
    seqs, next_block = [], 1
    for _ in range(n_seqs):
        n = rng.randint(64, 1024)
        s = Sequence([rng.randrange(vocab) for _ in range(n)],
                     SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        blocks = -(-n // block_size)
        s.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        s.num_cached_tokens = n - 1
        seqs.append(s)
    sched = SchedulerOutput(seqs=seqs, num_new_tokens=[1] * n_seqs)
    items = [(s, 1) for s in seqs]
    rows = []
    for threads, threshold in ((0, 512), (2, 64)):
        b = BatchInputBuilder(block_size, vocab, 0, num_threads=threads,
                              parallel_threshold=threshold)
        for fn_name, fn in (("build_forward_input", lambda b=b: b.build_forward_input(sched)),
                            ("process_sequences", lambda b=b: b.process_sequences(items))):
            for _ in range(5):
                fn()
            ts = []
            for _ in range(runs):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            ts.sort()
            rows.append({"fn": fn_name, "num_threads": threads, "parallel_threshold": threshold,
                         "median_ms": 1e3 * statistics.median(ts),
                         "p90_ms": 1e3 * ts[int(0.9 * (len(ts) - 1))]})
    return rows


def model_folder(name: str, args, tmp: Path) -> Path:
    if name == "smollm2":
        from launch.default_model import prepare_default_model

        return Path(prepare_default_model(progress=False))
    if name == "random100m":
        return make_random_llama(tmp / "random100m", DTYPES[args.dtype])
    return Path(name)


def bench_model(name: str, folder: Path, args, sizes: dict) -> dict:
    dtype = DTYPES[args.dtype]
    cfg = ModelConfig.from_folder(folder)
    res = {"model": name, "folder": str(folder), "dtype": args.dtype,
           "matmul_params": matmul_params(cfg), "workloads": {}}
    batch, dec_prompt, dec_steps = sizes["decode"]
    shapes = linear_shapes(cfg)
    res["calibration"] = {
        "decode_dtype": matmul_calibration(shapes, batch, dtype),
        "decode_fp32": matmul_calibration(shapes, batch, torch.float32),
        "prefill_dtype": matmul_calibration(shapes, 512, dtype),
    }
    n_mixed, (p_lo, p_hi), (o_lo, o_hi) = sizes["mixed"]
    max_len = max(p_hi + o_hi, dec_prompt + dec_steps + 1)
    max_seqs = max(n_mixed, sizes["uniform"][0], batch)
    llm = LLM(folder, dtype=args.dtype, max_num_seqs=max_seqs, max_num_batched_tokens=2048,
              block_size=16, enable_prefix_caching=False,
              num_gpu_blocks=max_seqs * -(-max_len // 16) + 1)
    hf = HFRunner(folder, dtype)
    warm = random_requests(2, (8, 8), (4, 4), cfg.vocab_size, seed=99)
    run_ours(llm, warm, "warm-up ours")
    hf.generate(warm, 2, "warm-up HF")
    workloads = {
        "mixed": lambda: random_requests(n_mixed, (p_lo, p_hi), (o_lo, o_hi),
                                         cfg.vocab_size, seed=1),
        "uniform": lambda: random_requests(sizes["uniform"][0], (sizes["uniform"][1],) * 2,
                                           (sizes["uniform"][2],) * 2, cfg.vocab_size, seed=2),
        "short": lambda: random_requests(sizes["short"][0], *sizes["short"][1:],
                                         cfg.vocab_size, seed=5),
    }
    for wl in args.workloads:
        reqs = workloads[wl]()
        useful = sum(r.max_tokens for r in reqs)
        ours_tok, ours_s, ours_stats = run_ours(llm, reqs, f"{name}/{wl} ours")
        hf_bs = len(reqs) if wl == "uniform" else args.hf_batch
        hf_tok, hf_s, hf_computed = hf.generate(reqs, hf_bs, f"{name}/{wl} HF")
        bad = [i for i, (t, r) in enumerate(zip(ours_tok, reqs, strict=True))
               if len(t) != r.max_tokens]
        res["workloads"][wl] = {
            "requests": len(reqs), "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "useful_tokens": useful, "ours_s": ours_s, "ours_tok_s": useful / ours_s,
            "hf_s": hf_s, "hf_tok_s": useful / hf_s, "ratio": hf_s / ours_s,
            "hf_batch": hf_bs, "hf_computed_tokens": hf_computed,
            "ours_wrong_lengths": len(bad), **{f"ours_{k}": v for k, v in ours_stats.items()},
            "agreement": agreement(ours_tok, hf_tok),
        }
    del hf
    gc.collect()
    dec = measure_decode_step(llm, cfg, batch, dec_prompt, dec_steps, seed=3)
    for key, cal in (("limit_s", "decode_dtype"), ("limit_fp32_s", "decode_fp32")):
        c = res["calibration"][cal]
        dec[key] = c["seconds"] + dec["attn_flops"] / (c["gflops"] * 1e9)
    dec["ratio"] = dec["median_s"] / dec["limit_s"]
    res["decode"] = dec
    res["vocab_size"] = cfg.vocab_size
    del llm
    gc.collect()
    return res


def report(facts: dict, results: list[dict], builder: list, args) -> str:
    out = ["## Machine", ""]
    out += [f"- {k}: {v}" for k, v in facts.items()]
    out += ["", f"## Offline throughput ({args.dtype}, greedy, ignore_eos)", ""]
    rows = []
    for r in results:
        for wl, w in r["workloads"].items():
            rows.append([r["model"], wl, w["requests"], w["prompt_tokens"], w["useful_tokens"],
                         w["ours_s"], w["ours_tok_s"], w["hf_s"], w["hf_tok_s"],
                         f"{w['ratio']:.2f}x", w["hf_batch"], w["hf_computed_tokens"],
                         f"{w['agreement']['identical']}/{w['agreement']['total']}"])
    out.append(md_table(["model", "workload", "requests", "prompt tok", "useful out tok",
                         "ours s", "ours tok/s", "HF s", "HF tok/s", "ours/HF", "HF batch",
                         "HF computed tok", "identical greedy"], rows))
    out += ["", "tok/s = useful output tokens / wall s (prefill included). HF batching: "
            "requests sorted by prompt length, batches of up to `HF batch`, left padding + "
            "attention_mask, each batch decodes to its longest output; `HF computed tok` = "
            "sum over batches of batch x (padded prompt + generated). Ours: all requests at "
            "once (continuous batching, chunked prefill, max_num_batched_tokens=2048).", ""]
    out += ["## Decode step vs. machine limit", ""]
    rows = []
    for r in results:
        d, c = r["decode"], r["calibration"]
        rows.append([r["model"], d["batch"], round(d["mean_kv_len"]), 1e3 * d["median_s"],
                     c["decode_dtype"]["gflops"], 1e3 * d["limit_s"], f"{d['ratio']:.2f}",
                     c["decode_fp32"]["gflops"], 1e3 * d["limit_fp32_s"],
                     c["prefill_dtype"]["gflops"]])
    out.append(md_table(["model", "batch", "mean KV len", "step ms (median)",
                         f"{args.dtype} GFLOP/s @batch", "limit ms", "step/limit",
                         "fp32 GFLOP/s @batch", "fp32 limit ms",
                         f"{args.dtype} GFLOP/s @512 rows"], rows))
    out += ["", "limit = the model's matmuls (fused qkv, o, gate_up, down, LM head; "
            "torch.matmul(x, W.T) on the same shapes, timed in this run) + attention FLOPs "
            "(4 x heads x head_dim x KV len x layers per sequence) at the same rate. "
            f"x @ B with B [in, out] contiguous ({args.dtype}): "
            f"{naive_layout_gflops(DTYPES[args.dtype]):.1f} GFLOP/s.", ""]
    out += ["## build_forward_input, 256 decode sequences (lengths 64-1024)", ""]
    out.append(md_table(["function", "num_threads", "parallel_threshold", "median ms",
                         "p90 ms"],
                        [[b["fn"], b["num_threads"], b["parallel_threshold"], b["median_ms"],
                          b["p90_ms"]] for b in builder]))
    out += ["", f"load average at end: {[round(x, 2) for x in os.getloadavg()]}"]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, smollm2 only (smoke)")
    ap.add_argument("--model", help="benchmark this HF folder instead of --models")
    ap.add_argument("--models", default=None, help="comma list: smollm2,random100m")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--workloads", default="mixed,uniform,short")
    ap.add_argument("--hf-batch", type=int, default=16, help="HF batch size for mixed")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--peer", choices=["vllm"], help="against vLLM's CPU backend instead of "
                    "HF (bench/versus_vllm.py; needs `make bench-peer`)")
    ap.add_argument("--rounds", type=int, default=2, help="--peer: rounds of each engine")
    args = ap.parse_args(argv)
    if args.peer:
        from bench import versus_vllm

        wls = args.workloads
        folder = args.model or str(model_folder("smollm2", args, Path(".")))
        return versus_vllm.main(folder, args.dtype, [w for w in wls.split(",") if w],
                                args.rounds, args.json, quick=args.quick)
    args.workloads = [w for w in args.workloads.split(",") if w]
    if bad := set(args.workloads) - {"mixed", "uniform", "short"}:
        ap.error(f"unknown workloads: {sorted(bad)}")
    sizes = QUICK if args.quick else FULL
    if args.model:
        models = [args.model]
    else:
        models = (args.models or ("smollm2" if args.quick else "smollm2,random100m")).split(",")
    facts = machine_facts()
    print("\n".join(f"{k}: {v}" for k, v in facts.items()), flush=True)
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        for name in models:
            folder = model_folder(name, args, Path(tmp))
            print(f"== {name}: {folder}", flush=True)
            results.append(bench_model(name, folder, args, sizes))
    builder = bench_builder(results[0]["vocab_size"], 16, *sizes["builder"], seed=4)
    text = report(facts, results, builder, args)
    print("\n" + text + f"\n\ntotal wall time: {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"facts": facts, "results": results,
                                               "builder": builder}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
