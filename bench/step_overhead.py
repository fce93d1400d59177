"""Host cost of one engine step at a large decode batch: where a step's time goes outside
the model's kernels.

    .venv/bin/python bench/step_overhead.py [--batch 64] [--dtype float32] [--steps 40]
        [--prompt-len 64]

Runs `--batch` requests (`--prompt-len`-token prompts: 64 by default, 500 to see decode
attention at the context lengths of the offline mixed workload) to decode-only steps through
`LLMEngine.run_once` (what a node's engine loop calls) and times, per step: the scheduler,
`build_forward_input`, the worker (H2D, forward, logits, sampling), the scheduler's
postprocess and the outputs (detokenizing included). Then one step under torch.profiler:
host cost = the step's wall time less the time inside aten operators and the C++ kernels
(their self time), i.e. Python and dispatch. The issue's target: under 2 ms a step at
batch 64.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import random_requests  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from launch.default_model import prepare_default_model  # noqa: E402

PARTS = ("schedule", "build", "worker", "postprocess", "outputs")


def _timed(times: dict, name: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        times[name].append(time.perf_counter() - t)
        return out
    return wrapper


def _add(engine, tag: str, batch: int, max_tokens: int, vocab: int, prompt_len: int) -> None:
    lens = (prompt_len, prompt_len)
    for i, r in enumerate(random_requests(batch, lens, (max_tokens,) * 2, vocab, seed=7)):
        engine.add_request(f"{tag}{i}", r.prompt, SamplingParams(
            max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens in each prompt")
    ap.add_argument("--model", help="an HF folder (default: the default model)")
    ap.add_argument("--top", type=int, default=0,
                    help="also list the N operators with the most self time in the step")
    args = ap.parse_args(argv)
    folder = args.model or prepare_default_model(progress=False)
    llm = LLM(folder, dtype=args.dtype, max_num_seqs=args.batch)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    times = {p: [] for p in PARTS}
    sched, worker = engine.scheduler, engine.worker
    originals = (sched.schedule, engine.builder.build_forward_input, worker.step,
                 sched.postprocess, engine.take_outputs)
    sched.schedule = _timed(times, "schedule", sched.schedule)
    engine.builder.build_forward_input = _timed(times, "build", originals[1])
    worker.step = _timed(times, "worker", worker.step)
    sched.postprocess = _timed(times, "postprocess", sched.postprocess)
    engine.take_outputs = _timed(times, "outputs", engine.take_outputs)
    _add(engine, "a", args.batch, args.steps + 1, vocab, args.prompt_len)
    walls = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.run_once()
        walls.append(time.perf_counter() - t)
    decode = slice(3, len(walls) - 1)        # past the prefill steps, before the last
    print(f"batch {args.batch}, {args.dtype}, {len(walls[decode])} decode steps, "
          f"torch threads {torch.get_num_threads()}")
    print(f"  {'step (run_once)':18s} {1e3 * statistics.median(walls[decode]):8.2f} ms")
    for p in PARTS:
        print(f"  {p:18s} {1e3 * statistics.median(times[p][decode]):8.2f} ms")
    (sched.schedule, engine.builder.build_forward_input, worker.step, sched.postprocess,
     engine.take_outputs) = originals
    _add(engine, "b", args.batch, 8, vocab, args.prompt_len)
    for _ in range(4):
        engine.run_once()                     # prefill and the first decode steps
    hosts = []
    for _ in range(3):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            engine.run_once()
            wall = time.perf_counter() - t
        ops = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
        hosts.append((wall, ops, prof))
    wall, ops, prof = sorted(hosts, key=lambda h: h[0])[1]
    print(f"profiled step: wall {1e3 * wall:.2f} ms, in operators {1e3 * ops:.2f} ms, "
          f"host (Python + dispatch) {1e3 * (wall - ops):.2f} ms")
    if args.top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
