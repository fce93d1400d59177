"""Graph-replayed decode against eager decode, in one process, on the same weights and the
same requests: decode step time at batch 1, 8 and 32, and the greedy tokens compared.

    .venv/bin/python bench/graph_decode.py [--device cuda|cpu] [--batches 1,8,32]
        [--prompt-len 64] [--steps 32] [--dtype auto] [--model DIR] [--json out.json]

Two engines over the default model (SmolLM2-135M-Instruct) unless --model: one eager,
one with `enable_graph=True`. For each batch size, both get the same random prompts
(greedy, ignore_eos); after the prefill and a few untimed decode steps (the graph
engine captures its bucket there), `--steps` decode steps are timed.

  step ms     median of one whole engine step (schedule, build inputs, H2D, forward,
              logits, sampling, postprocess), the device synchronised before and after
  forward ms  median of the executor's forward alone on one prepared decode batch,
              synchronised before and after (graph engine: bind the batch into the
              persistent buffers + replay)
  tokens      sequences whose greedy tokens are identical in both engines

Timed steps alternate between the two engines, so a shared machine's load changes
affect both alike.

`--device` defaults to cuda when a GPU is present, else cpu. On CPU the "graph" reruns
the captured callable (engine/device.py), so no speed-up is expected there; that run
only proves the path works end to end.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_facts, md_table  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine_core import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

WARM_STEPS = 3      # untimed decode steps before timing: captures, allocator warm-up


def _sync(engine: LLMEngine) -> None:
    engine.device.synchronize()


def _timed(engine: LLMEngine, fn) -> float:
    _sync(engine)
    t = time.perf_counter()
    fn()
    _sync(engine)
    return time.perf_counter() - t


def run_batch(engines: dict[str, LLMEngine], prompts: list[list[int]], steps: int,
              tag: str) -> dict:
    """Both engines run the same requests; every timed step alternates between them, so
    a load change on a shared machine hits both alike."""
    sp = SamplingParams(max_tokens=WARM_STEPS + steps + 2, temperature=0.0, ignore_eos=True)
    seqs = {m: [e.add_request(f"{tag}-{m}-{i}", p, sp) for i, p in enumerate(prompts)]
            for m, e in engines.items()}
    for m, e in engines.items():
        while any(s.num_output_tokens == 0 for s in seqs[m]):   # prefill (eager in both)
            e.step()
        for _ in range(WARM_STEPS):
            e.step()
    step_s = {m: [] for m in engines}
    for _ in range(steps):
        for m, e in engines.items():
            # a step ends with the sampled tokens' copy to the host (a sync) anyway
            step_s[m].append(_timed(e, e.step))
    # the executor's forward alone on each engine's next decode batch (not applied: it
    # writes the same K/V values at the same slots every time)
    batch = {}
    for m, e in engines.items():
        fi = e.builder.build_forward_input(e.scheduler.schedule())
        assert fi.attn.is_decode_only and fi.attn.num_decodes == len(prompts)
        batch[m] = e.worker.prepare_work_before_execute(fi).input
        e.worker.executor.forward(batch[m])          # the graph engine has it captured
    forward_s = {m: [] for m in engines}
    for _ in range(steps):
        for m, e in engines.items():
            forward_s[m].append(_timed(e, lambda e=e, m=m: e.worker.executor.forward(batch[m])))
    out = {}
    for m, e in engines.items():
        out[m] = {"step_ms": 1e3 * statistics.median(step_s[m]),
                  "forward_ms": 1e3 * statistics.median(forward_s[m]),
                  "tokens": [list(s.output_token_ids) for s in seqs[m]]}
        for s in seqs[m]:
            e.abort(s.request_id)
            e.release(s.request_id)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto",
                    choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--model", help="HF folder (default: the default model)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.model:
        folder = Path(args.model)
    else:
        from launch.default_model import prepare_default_model
        folder = Path(prepare_default_model(progress=True))
    facts = machine_facts()
    if args.device.startswith("cuda"):
        facts["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    print("\n".join(f"{k}: {v}" for k, v in facts.items()), flush=True)

    max_len = args.prompt_len + WARM_STEPS + args.steps + 8
    # every prompt of a batch prefilled in one step: with the default 2048-token budget,
    # batch 64 x 64 tokens took three steps, the first prompts ran two decode steps ahead and
    # reached max_tokens before the timed forward, which then had fewer than 64 rows
    common = dict(model=str(folder), device=args.device, dtype=args.dtype,
                  max_num_seqs=max(batches), max_model_len=max_len,
                  max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),
                  enable_prefix_caching=False)
    engines = {
        "eager": LLMEngine(EngineConfig(**common)),
        # the graphs' block tables are as wide as the longest sequence here needs
        "graph": LLMEngine(EngineConfig(**common, enable_graph=True,
                                        graph_max_seq_len=max_len)),
    }
    print(f"model {folder.name}, {engines['eager'].dtype}, device {args.device}", flush=True)
    rows, results = [], []
    for b in batches:
        rng = random.Random(b)
        vocab = engines["eager"].vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(b)]
        res = run_batch(engines, prompts, args.steps, f"b{b}")
        same = sum(x == y for x, y in zip(res["eager"]["tokens"], res["graph"]["tokens"],
                                          strict=True))
        e, g = res["eager"], res["graph"]
        rows.append([b, e["step_ms"], g["step_ms"], e["step_ms"] / g["step_ms"],
                     e["forward_ms"], g["forward_ms"], e["forward_ms"] / g["forward_ms"],
                     f"{same}/{b}"])
        results.append({"batch": b, **{f"{m}_{k}": v for m in res
                                       for k, v in res[m].items() if k != "tokens"},
                        "identical_sequences": same})
        print(md_table(["batch", "eager step ms", "graph step ms", "step speed-up",
                        "eager fwd ms", "graph fwd ms", "fwd speed-up", "tokens identical"],
                       rows[-1:]), flush=True)
    graph_stats = engines["graph"].stats()
    print("\n" + md_table(["batch", "eager step ms", "graph step ms", "step speed-up",
                           "eager fwd ms", "graph fwd ms", "fwd speed-up",
                           "tokens identical"], rows))
    print(f"\ngraph engine: captures {graph_stats['graph_captures']}, replays "
          f"{graph_stats['graph_replays']}, eager fallbacks {graph_stats['graph_fallbacks']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"facts": facts, "args": vars(args),
                                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
