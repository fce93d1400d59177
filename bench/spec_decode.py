"""Speculative decoding (MTP) against plain decoding, in one process, on the default model
with its trained draft head: decode tokens/s with num_speculative_tokens k = 1, 2, 3 vs
off, at batch 1 and 8, with acceptance lengths and per-position acceptance rates, for
each of two held-out prompt sets.

    .venv/bin/python bench/spec_decode.py [--model DIR] [--sets chat,raw] [--batches 1,8]
        [--ks 1,2,3] [--max-tokens 96] [--reps 2] [--dtype auto] [--threads 1] [--graph]
        [--no-speed] [--json out.json]

Sets (all kept out of the head's training, checked by tools/mtp_corpus.py,
tests/tools/test_mtp_raw.py and tests/tools/test_mtp_styles.py):
- chat: chat requests (chat template) on TOPICS below x ASKS (64 prompts);
- raw: tools/mtp_raw.py's held-out raw-text openings (no chat template: code in several
  languages, prose, lists, dialogue, questions; 64 prompts), as the completions API
  gets them;
- styles: tools/mtp_styles.py, 12 request styles the corpus never uses (6 requests each)
  and 5 kinds of raw source it does not draw on (4 openings each), one set each, with
  the median style and the weakest per k (issue 39). `--sets styles --batches 1 --ks 1,3
  --max-tokens 64 --dtype float32` is that issue's measurement.
Greedy, ignore_eos, so every mode does the same work; the modes run interleaved, rep after
rep, and the table shows medians, so load from other processes hits them alike. tokens/s
= output tokens per second of wall time (prompts are short, so this is decode-dominated).
`identical` counts the sequences whose tokens equal plain decoding's (in float32 they must
all be; in bf16 the verify rows' different kernel shapes may flip a near-tie). The
acceptance phase runs every prompt of a set as one batch per k (float32 verify is exact,
so the batch does not change acceptance) beside one plain batch, and counts `identical`
over every prompt; `--no-speed` runs only that phase (evaluating a head).
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
from tools.mtp_raw import held_out_raw_texts  # noqa: E402
from tools.mtp_styles import chat_requests, raw_texts  # noqa: E402

TOPICS = ["lighthouses", "the Great Wall of China", "knitting", "penguins", "tea ceremonies",
          "solar panels", "the Olympic games", "a pirate ship", "bicycles", "coral reefs",
          "the violin", "snowflakes", "a space station", "marathon training",
          "ancient Greek philosophy", "a city park"]
ASKS = ["Tell me about {t}.", "Write a short story about {t}.",
        "Explain {t} to a ten-year-old.", "Give me three facts about {t}."]


def chat_convs() -> list[list[dict]]:
    """Every topic x request, topics first (a batch of n sees n different topics)."""
    return [[{"role": "user", "content": ASKS[(j // len(TOPICS)) % len(ASKS)].format(
        t=TOPICS[j % len(TOPICS)])}] for j in range(len(TOPICS) * len(ASKS))]


def prompt_sets(tok, names: list[str]) -> dict[str, list[dict]]:
    """{set name: prompts as token ids}: chat through the chat template, as LLM.chat
    encodes them; raw as LLM.generate encodes a string."""
    sets = {}
    if "chat" in names:
        sets["chat"] = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c, True),
                                                        add_special_tokens=False)}
                        for c in chat_convs()]
    if "raw" in names:
        sets["raw"] = [{"prompt_token_ids": tok.encode(t)} for t in held_out_raw_texts()]
    if "styles" in names:       # tools/mtp_styles.py: one set per style and raw source
        for style, reqs in chat_requests().items():
            sets[f"chat:{style}"] = [{"prompt_token_ids": tok.encode(
                tok.apply_chat_template([{"role": "user", "content": r}], True),
                add_special_tokens=False)} for r in reqs]
        for source, texts in raw_texts().items():
            sets[f"raw:{source}"] = [{"prompt_token_ids": tok.encode(t)} for t in texts]
    return sets


def style_summary(acceptance: dict, ks: list[int]) -> str:
    """Per k, over the styled sets: the median style's acceptance length and the weakest
    style, chat and raw apart (issue 39's targets read these)."""
    rows = []
    for kind in ("chat", "raw"):
        for k in ks:
            got = {name.split(":", 1)[1]: v["acceptance_length"]
                   for key, v in acceptance.items()
                   for name in [key.rsplit("_k", 1)[0]]
                   if name.startswith(f"{kind}:") and key.endswith(f"_k{k}")}
            if not got:
                continue
            ordered = sorted(got.values())
            weakest = min(got, key=got.get)
            rows.append([kind, k, len(got), f"{statistics.median(ordered):.3f}",
                         f"{weakest} {got[weakest]:.3f}"])
    return md_table(["kind", "k", "styles", "median style", "weakest style"], rows)


def pick(prompts: list[dict], n: int, offset: int) -> list[dict]:
    return [prompts[(offset + i) % len(prompts)] for i in range(n)]


def run_once(llm: LLM, prompts: list[dict], max_tokens: int
             ) -> tuple[float, list[list[int]]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    return dt, [o.outputs[0].token_ids for o in outs]


def spec_delta(st: dict, before: dict, k: int) -> tuple[float | None, list[float]]:
    """(acceptance length, cumulative per-position rates) between two stats() snapshots."""
    drafts = st["spec_num_drafts"] - before["spec_num_drafts"]
    acc = st["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    per_pos = [(st["spec_num_accepted_per_position"][j]
                - before["spec_num_accepted_per_position"][j])
               / max(1, st["spec_num_proposed_per_position"][j]
                     - before["spec_num_proposed_per_position"][j]) for j in range(k)]
    return (1 + acc / drafts if drafts else None), per_pos


def measure_acceptance(llms: dict, ks: list[int], sets: dict, max_tokens: int) -> dict:
    """Acceptance length and per-position rates of each k over every prompt of each set,
    run as one batch per (set, k)."""
    rows, out = [], {}
    for name, prompts in sets.items():
        _, plain = run_once(llms[0], prompts, max_tokens)
        for k in ks:
            before = dict(llms[k].stats())
            _, got = run_once(llms[k], prompts, max_tokens)
            length, per_pos = spec_delta(llms[k].stats(), before, k)
            same = sum(a == b for a, b in zip(plain, got, strict=True))
            out[f"{name}_k{k}"] = {"acceptance_length": round(length, 3),
                                   "per_position": [round(a, 3) for a in per_pos],
                                   "identical": f"{same}/{len(plain)}"}
            rows.append([name, k, f"{length:.3f}", ", ".join(f"{a:.3f}" for a in per_pos),
                         f"{same}/{len(plain)}"])
    print()
    sizes = ", ".join(f"{n}: {len(p)} prompts" for n, p in sets.items())
    print(f"acceptance over each held-out set ({sizes}) x {max_tokens} tokens, one batch:")
    print(md_table(["set", "k", "acceptance length", "per position (cumulative)",
                    "identical to off"], rows))
    return out


def measure_speed(llms: dict, name: str, prompts: list[dict], b: int, ks: list[int],
                  reps: int, max_tokens: int, rows: list, results: dict) -> None:
    modes = [0] + ks
    times = {k: [] for k in modes}
    outputs: dict[int, list] = {}
    before = {k: dict(llms[k].stats()) for k in ks}
    for rep in range(reps):
        batch = pick(prompts, b, rep * b)
        for k in modes:
            dt, toks = run_once(llms[k], batch, max_tokens)
            times[k].append(dt)
            outputs.setdefault(k, []).extend(toks)
    ntok = b * max_tokens
    base = ntok / statistics.median(times[0])
    for k in modes:
        tps = ntok / statistics.median(times[k])
        same = sum(a == c for a, c in zip(outputs[0], outputs[k], strict=True))
        entry = {"set": name, "batch": b, "k": k, "tokens_per_s": round(tps, 2),
                 "speedup": round(tps / base, 3), "identical": f"{same}/{len(outputs[0])}"}
        if k:
            length, per_pos = spec_delta(llms[k].stats(), before[k], k)
            entry["acceptance_length"] = None if length is None else round(length, 3)
            entry["acceptance_per_position(cumulative)"] = [round(r, 3) for r in per_pos]
        results[f"{name}_b{b}_k{k}"] = entry
        rows.append([name, b, "off" if k == 0 else f"MTP k={k}", f"{tps:.1f}",
                     f"{tps / base:.2f}x", entry.get("acceptance_length", "-"),
                     entry["identical"]])
        print(entry, flush=True)


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
    ap.add_argument("--sets", default="chat,raw", help="held-out prompt sets: chat, raw, "
                    "styles (tools/mtp_styles.py: one set per request style and raw source, "
                    "with a median-style summary)")
    ap.add_argument("--no-speed", action="store_true",
                    help="skip the timed runs: acceptance only (evaluating a head)")
    ap.add_argument("--no-acceptance", action="store_true",
                    help="skip the acceptance phase over every prompt of each set")
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
    llms = {k: LLM(folder, dtype=args.dtype, max_num_seqs=max(*batches, 64), **graph,
                   **({"speculative_method": "mtp", "num_speculative_tokens": k} if k else {}))
            for k in modes}
    sets = prompt_sets(llms[0].tokenizer, args.sets.split(","))
    print(f"model {folder} dtype {llms[0].engine.dtype} threads {args.threads}")
    for llm in llms.values():       # warm-up
        run_once(llm, [{"prompt_token_ids": [1, 2, 3, 4]}], 8)

    rows, results = [], {}
    for name, prompts in sets.items():
        for b in ([] if args.no_speed else batches):
            measure_speed(llms, name, prompts, b, ks, args.reps, args.max_tokens, rows,
                          results)
    if rows:
        print()
        print(md_table(["set", "batch", "mode", "tokens/s", "vs off", "acceptance length",
                        "identical to off"], rows))
    if not args.no_acceptance and ks:
        results["acceptance"] = measure_acceptance(llms, ks, sets, args.max_tokens)
        if "styles" in args.sets.split(","):
            print()
            print("by style (tools/mtp_styles.py):")
            print(style_summary(results["acceptance"], ks))
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
