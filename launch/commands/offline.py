"""`pdserve offline`: the offline engine (no cluster) on the default model: a few chat
prompts, their text and the tokens/s."""

from __future__ import annotations

import argparse
import time

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "List three prime numbers.",
)


HELP = "run the engine in-process on a few prompts (offline demo, no cluster)"


def run(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from launch.cli_common import CliError

    model = args.model
    if model is None:
        from launch.default_model import prepare_default_model
        model = prepare_default_model(progress=True)
    try:
        llm = LLM(model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs)
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompts = args.prompt or list(DEMO_PROMPTS)
    print(f"model: {model}  dtype: {llm.engine.dtype}  device: {args.device}", flush=True)
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                    use_tqdm=True)
    elapsed = time.perf_counter() - t0
    generated = 0
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        generated += len(completion.token_ids)
        print(f"\n>>> {prompt}\n{completion.text.strip()}\n"
              f"[{len(completion.token_ids)} tokens, finish: {completion.finish_reason}]")
    print(f"\n{len(prompts)} requests, {generated} tokens in {elapsed:.2f} s: "
          f"{generated / elapsed:.1f} tokens/s", flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="HF model folder (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu | cuda[:i] | npu[:i]")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("prompt", nargs="*", help="prompts (default: a few built-in ones)")
