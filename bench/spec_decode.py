"""Speculative decoding (MTP) against plain decoding, in one process, on the default model
with its trained draft head: decode tokens/s with num_speculative_tokens k = 1, 2, 3 vs
off, at batch 1 and 8, with acceptance lengths and per-position acceptance rates.

    .venv/bin/python bench/spec_decode.py [--model DIR] [--batches 1,8] [--ks 1,2,3]
        [--max-tokens 96] [--reps 2] [--dtype auto] [--threads 1] [--graph] [--json out.json]

Prompts are chat requests on topics the head never saw in training (tools/train_mtp.py
keeps its own held-out set; these are others). Greedy, ignore_eos, so every mode does the
same work; the modes run interleaved, rep after rep, and the table shows medians, so load
from other processes hits them alike. tokens/s = output tokens per second of wall time
(prompts are short, ~40 tokens, so this is decode-dominated). `identical` counts the
sequences whose tokens equal plain decoding's (in float32 they must all be; in bf16 the
verify rows' different kernel shapes may flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_facts, md_table  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

TOPICS = ["lighthouses", "the Great Wall of China", "knitting", "penguins", "tea ceremonies",
          "solar panels", "the Olympic games", "a pirate ship", "bicycles", "coral reefs",
          "the violin", "snowflakes", "a space station", "marathon training",
          "ancient Greek philosophy", "a city park"]
ASKS = ["Tell me about {t}.", "Write a short story about {t}.",
        "Explain {t} to a ten-year-old.", "Give me three facts about {t}."]


def prompts(n: int, offset: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        j = offset + i
        t = TOPICS[j % len(TOPICS)]
        out.append([{"role": "user", "content": ASKS[(j // len(TOPICS)) % len(ASKS)].format(
            t=t)}])
    return out


def run_once(llm: LLM, convs, max_tokens: int) -> tuple[float, list[list[int]]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.chat(convs, sp)
    dt = time.perf_counter() - t
    return dt, [o.outputs[0].token_ids for o in outs]


def measure_acceptance(llms: dict, ks: list[int], n: int, max_tokens: int) -> dict:
    """Acceptance length and per-position rates of each k over `n` prompts (every
    topic x request), run as one batch: acceptance does not depend on the batch (float32
    verify is exact), and n prompts average over far more text than the speed cells."""
    rows, out = [], {}
    convs = prompts(n, 0)
    for k in ks:
        before = dict(llms[k].stats())
        run_once(llms[k], convs, max_tokens)
        st = llms[k].stats()
        drafts = st["spec_num_drafts"] - before["spec_num_drafts"]
        acc = st["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        per_pos = [(st["spec_num_accepted_per_position"][j]
                    - before["spec_num_accepted_per_position"][j])
                   / max(1, st["spec_num_proposed_per_position"][j]
                         - before["spec_num_proposed_per_position"][j]) for j in range(k)]
        out[f"k{k}"] = {"acceptance_length": round(1 + acc / drafts, 3),
                        "per_position": [round(a, 3) for a in per_pos],
                        "drafts": drafts}
        rows.append([k, f"{1 + acc / drafts:.3f}",
                     ", ".join(f"{a:.3f}" for a in per_pos), drafts])
    print()
    print(f"acceptance over {n} prompts x {max_tokens} tokens (one batch):")
    print(md_table(["k", "acceptance length", "per position (cumulative)", "draft rounds"],
                   rows))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF folder with an MTP head (default: the prepared "
                                    "default model)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--graph", action="store_true",
                    help="enable_graph for every mode (verify batches replay graphs too)")
    ap.add_argument("--graph-max-seq-len", type=int, default=512,
                    help="with --graph: block-table width of the graphs (every replay "
                         "attends over all of it)")
    ap.add_argument("--acceptance-prompts", type=int, default=len(TOPICS) * len(ASKS),
                    help="also measure acceptance lengths over this many prompts, batched "
                         "(0: skip); the speed cells see few prompts at batch 1")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        folder = Path(args.model)
    else:
        from launch.default_model import prepare_default_model
        folder = prepare_default_model()
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    modes = [0] + ks
    graph = ({"enable_graph": True, "graph_max_seq_len": args.graph_max_seq_len}
             if args.graph else {})
    llms = {k: LLM(folder, dtype=args.dtype, max_num_seqs=max(*batches, 32), **graph,
                   **({"speculative_method": "mtp", "num_speculative_tokens": k} if k else {}))
            for k in modes}
    print(f"model {folder} dtype {llms[0].engine.dtype} threads {args.threads}")
    for llm in llms.values():       # warm-up
        run_once(llm, prompts(1, 99), 8)

    rows, results = [], {}
    for b in batches:
        times = {k: [] for k in modes}
        outputs: dict[int, list] = {}
        spec_before = {k: dict(llms[k].stats()) for k in ks}
        for rep in range(args.reps):
            convs = prompts(b, rep * b)
            for k in modes:
                dt, toks = run_once(llms[k], convs, args.max_tokens)
                times[k].append(dt)
                outputs.setdefault(k, []).extend(toks)
        ntok = b * args.max_tokens
        base = ntok / statistics.median(times[0])
        for k in modes:
            tps = ntok / statistics.median(times[k])
            same = sum(a == c for a, c in zip(outputs[0], outputs[k], strict=True))
            entry = {"batch": b, "k": k, "tokens_per_s": round(tps, 2),
                     "speedup": round(tps / base, 3),
                     "identical": f"{same}/{len(outputs[0])}"}
            if k:
                st, st0 = llms[k].stats(), spec_before[k]
                drafts = st["spec_num_drafts"] - st0["spec_num_drafts"]
                acc = st["spec_num_accepted_tokens"] - st0["spec_num_accepted_tokens"]
                entry["acceptance_length"] = round(1 + acc / drafts, 3) if drafts else None
                entry["acceptance_per_position(cumulative)"] = [
                    round(r, 3) if r is not None else None
                    for r in st["spec_acceptance_rate_per_position"]]
            results[f"b{b}_k{k}"] = entry
            rows.append([b, "off" if k == 0 else f"MTP k={k}", f"{tps:.1f}",
                         f"{tps / base:.2f}x", entry.get("acceptance_length", "-"),
                         entry["identical"]])
            print(entry, flush=True)
    print()
    print(md_table(["batch", "mode", "tokens/s", "vs off", "acceptance length",
                    "identical to off"], rows))
    if args.acceptance_prompts and ks:
        results["acceptance"] = measure_acceptance(llms, ks, args.acceptance_prompts,
                                                   args.max_tokens)
    if args.graph:      # every verify batch should replay: fallbacks are the prompts only
        for k, llm in llms.items():
            st = llm.stats()
            print(f"k={k}: graph_replays {st['graph_replays']} captures "
                  f"{st['graph_captures']} fallbacks {st['graph_fallbacks']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_facts(), "args": vars(args),
                                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
