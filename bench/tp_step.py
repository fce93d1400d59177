"""Tensor parallel's cost and gain on this machine: the same offline batch with
tensor_parallel_size 1 and 2 (engine/parallel/).

    .venv/bin/python bench/tp_step.py [--model DIR] [--dtype bfloat16] [--requests 16]

The default model is a random Llama of ~100M parameters (hidden 768, 12 heads, 4 KV heads,
12 layers) made with transformers' from_config: SmolLM2-135M's 9 heads and 3 KV heads do
not split across 2 ranks.

Three runs of one batch (random prompts, greedy, ignore_eos): TP = 1 as shipped (the C++
kernels on), TP = 1 with the kernels off (what every rank of TP > 1 runs: the Python
layers, where the all-reduces sit) and TP = 2 (each rank one half of the cores). Prints the
CPU, wall time and output tok/s of each. On a 2-core machine TP cannot pay (the ranks
split the same two cores and add two all-reduces a layer); the figure is for the record.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_line, cpu_record  # noqa: E402


def run(model: str, dtype: str, requests: int, prompt: int, output: int, tp: int,
        env: dict[str, str]) -> tuple[float, int]:
    from engine import LLM, SamplingParams
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        llm = LLM(model, dtype=dtype, tensor_parallel_size=tp, max_num_seqs=requests)
        rng = random.Random(0)
        vocab = llm.engine.model_config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt)]}
                   for _ in range(requests)]
        params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))   # warm
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        llm.engine.close()
        return wall, sum(len(o.outputs[0].token_ids) for o in outs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def random_llama() -> str:
    import tempfile

    from transformers import AutoModelForCausalLM, LlamaConfig
    folder = Path(tempfile.mkdtemp(prefix="pdserve-tp-bench-")) / "random-llama-100m"
    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=2048, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return str(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: a random Llama)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    args = ap.parse_args()
    model = args.model or random_llama()
    print(cpu_line(cpu_record()))
    print(f"{args.requests} requests x {args.prompt} in / {args.output} out, {args.dtype}")
    off = {k: "0" for k in ("PDSERVE_CPU_ATTENTION_KERNEL", "PDSERVE_CPU_FUSED_OPS",
                            "PDSERVE_CPU_PACKED_LINEAR", "PDSERVE_CPU_DECODE_LAYERS",
                            "PDSERVE_CPU_BF16_GEMM")}
    for name, tp, env in (("TP = 1, kernels on", 1, {}), ("TP = 1, kernels off", 1, off),
                          ("TP = 2", 2, {})):
        wall, tokens = run(model, args.dtype, args.requests, args.prompt, args.output, tp,
                           env)
        print(f"  {name:22} {wall:7.2f} s  {tokens / wall:8.1f} output tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
