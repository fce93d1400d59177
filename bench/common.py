"""Helpers shared by the benchmarks in bench/: machine facts, matmul calibration, synthetic
workloads, a random Llama and the HF transformers baseline. No engine internals here.
"""

from __future__ import annotations

import copy
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


def machine_facts() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "os_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


# ---- matmul calibration ------------------------------------------------------------------
def _time_call(fn, min_seconds: float) -> float:
    """Median seconds per call of fn (after one warm-up call), over about min_seconds."""
    fn()
    times: list[float] = []
    end = time.perf_counter() + min_seconds
    while time.perf_counter() < end or len(times) < 3:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def linear_shapes(cfg) -> list[tuple[int, int, int]]:
    """(out_features, in_features, count) of every matmul in one forward of a Llama-style
    model with fused qkv and gate_up (engine layout), LM head included."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layers, inter = cfg.num_hidden_layers, cfg.intermediate_size
    return [(q + 2 * kv, h, layers), (h, q, layers), (2 * inter, h, layers),
            (h, inter, layers), (cfg.vocab_size, h, 1)]


def matmul_params(cfg) -> int:
    return sum(n * k * c for n, k, c in linear_shapes(cfg))


def matmul_calibration(shapes, m: int, dtype: torch.dtype, seconds: float = 0.3) -> dict:
    """Time torch.matmul(x[m, in], W[out, in].T) (nn.Linear's weight layout) for each
    shape; return the time one forward's matmuls take at m rows and the GFLOP/s."""
    total_t = total_f = 0.0
    for n, k, count in shapes:
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        t = _time_call(lambda x=x, w=w: torch.matmul(x, w.t()), seconds)
        total_t += t * count
        total_f += 2.0 * m * n * k * count
    return {"m": m, "seconds": total_t, "gflops": total_f / total_t / 1e9}


def naive_layout_gflops(dtype: torch.dtype, m: int = 32, k: int = 576, n: int = 1536) -> float:
    """x @ B with B [in, out] contiguous: a layout torch's CPU bf16 path handles badly."""
    x, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return 2.0 * m * n * k / _time_call(lambda: torch.matmul(x, b), 0.3) / 1e9


# ---- workloads -----------------------------------------------------------------------------
def random_requests(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_size: int, seed: int) -> list[Request]:
    """n requests of random token ids; lengths uniform in the inclusive ranges."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 2)       # keep clear of the special tokens at the bottom
    out = []
    for _ in range(n):
        plen, olen = rng.randint(*prompt_range), rng.randint(*output_range)
        out.append(Request([rng.randrange(low, vocab_size) for _ in range(plen)], olen))
    return out


def make_random_llama(folder: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """A randomly initialised ~100M-parameter Llama saved as an HF folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, intermediate_size=2048, vocab_size=32000,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(folder)
    del model
    return folder


# ---- the HF transformers baseline ------------------------------------------------------------
def hf_batches(requests: list[Request], batch_size: int) -> list[list[int]]:
    """Request indices sorted by prompt length (shortest first), cut into batches of up to
    batch_size: left padding stays small; each batch decodes to its longest output."""
    order = sorted(range(len(requests)), key=lambda i: (len(requests[i].prompt), i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


class HFRunner:
    """Batched greedy `generate` with left padding and an attention mask, EOS disabled."""

    def __init__(self, folder: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        self.pad_id = self._pad_id(folder)
        gc = copy.deepcopy(self.model.generation_config)
        gc.eos_token_id = None            # = ignore_eos: always generate max_new_tokens
        gc.pad_token_id = self.pad_id
        gc.do_sample = False
        self.gen_config = gc

    def _pad_id(self, folder: Path) -> int:
        try:
            from transformers import AutoTokenizer

            pad = AutoTokenizer.from_pretrained(folder).pad_token_id
        except Exception:   # a folder without a tokenizer (the random model)
            pad = None
        return pad if pad is not None else 0

    def generate(self, requests: list[Request], batch_size: int, desc: str = "HF"):
        """Returns (outputs per request, wall seconds, padded token count): outputs are
        truncated to what each request asked for."""
        from transformers import LogitsProcessor, LogitsProcessorList

        outputs: list[list[int] | None] = [None] * len(requests)
        computed = 0
        bar = tqdm(total=sum(r.max_tokens for r in requests), desc=desc, unit="tok")

        class Progress(LogitsProcessor):      # called once per decoding step
            def __init__(self, lens):
                self.lens, self.step = lens, 0

            def __call__(self, input_ids, scores):
                bar.update(sum(n > self.step for n in self.lens))
                self.step += 1
                return scores

        start = time.perf_counter()
        for batch in hf_batches(requests, batch_size):
            reqs = [requests[i] for i in batch]
            width = max(len(r.prompt) for r in reqs)
            new = max(r.max_tokens for r in reqs)
            ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(reqs), width), dtype=torch.long)
            for row, r in enumerate(reqs):
                ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
                mask[row, width - len(r.prompt):] = 1
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=new,
                    generation_config=self.gen_config,
                    logits_processor=LogitsProcessorList(
                        [Progress([r.max_tokens for r in reqs])]))
            for row, (i, r) in enumerate(zip(batch, reqs, strict=True)):
                outputs[i] = out[row, width:width + r.max_tokens].tolist()
            computed += len(reqs) * (width + new)
        elapsed = time.perf_counter() - start
        bar.close()
        return outputs, elapsed, computed


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many sequences are identical, and the mean length of the common prefix."""
    same, prefixes = 0, []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
        same += x == y
    return {"identical": same, "total": len(a),
            "mean_common_prefix": statistics.fmean(prefixes) if prefixes else 0.0}


def md_table(header: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) and abs(v) < 10 else (
            f"{v:,.1f}" if isinstance(v, float) else str(v))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
