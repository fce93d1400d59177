"""The CUDA path on a GPU machine, in one short run: greedy exactness against HF
transformers on the GPU (eager and graph-replayed decode), then graph-decode timings.

    python bench/cuda_check.py [--out DIR]

1. For each random tiny model of the exactness tests (tests/tiny_models.py) and a
   SmolLM2-135M-shaped random model, in float32 on cuda: HF `generate` (greedy) on each
   prompt, against our engine eager and with `enable_graph=True` on the same prompts in
   one batch. Reports the sequences whose tokens are identical to HF's, per engine, and
   eager against graph (which must be identical: the same kernels on the same rows).
2. `bench/graph_decode.py` on the SmolLM2-shaped model in bfloat16 at batch 1, 8, 32
   and 64.
3. MTP speculative decoding (`speculative_method="mtp"`): for each of --mtp-models, a
   copy with random MTP draft weights (tests/tiny_mtp.py); greedy tokens of plain eager
   decode (MTP off) against MTP k=1 and k=3, eager and graph-replayed (verify rows
   through graphs), which must be identical; with the acceptance and graph counters.
   Random drafts are almost never accepted, so each mode runs a second time with a
   scripted draft (the MTP still runs; its proposals are replaced by plain eager's
   tokens, a third of them wrong): full, partial and zero acceptance runs through graphs.
4. PD PUSH (bench/cuda_check_pd.py): for each of --pd-models, a prefill node and a decode
   node in one process (tests/pd_harness.PdPair), both on the device, KV over the
   in-process transport and over the raw-TCP data plane, decode eager and graph-replayed:
   greedy tokens against HF's and a single-node LLM's.

--sections picks among exactness,timing,mtp,pd (all by default).

Made for the GPU machine of this workplace (no internet, no default model there): it
needs only torch, transformers and this checkout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cuda_check_pd import PD_MODELS, pd_check  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.tiny_models import CONFIGS, make_tiny_model, random_prompts  # noqa: E402
from tests.tiny_tokenizer import add_tiny_tokenizer  # noqa: E402

# SmolLM2-135M's shapes (random weights: the real ones are too large to carry here)
SMOLLM2_SHAPE = ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, max_position_embeddings=2048,
                               tie_word_embeddings=True, rope_theta=100000.0))
MAX_NEW = 24


def hf_tokens(model, prompts: list[list[int]], device: str) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                             do_sample=False, pad_token_id=0, eos_token_id=2)
        out.append(gen[0, len(p):].tolist())
    return out


def ours_tokens(folder: Path, prompts: list[list[int]], graph: bool, device: str,
                stats: dict | None = None, script: dict | None = None, **kw
                ) -> list[list[int]]:
    llm = LLM(folder, device=device, dtype="float32", enable_graph=graph,
              kv_cache_memory_gb=1.0, **kw)
    if script is not None:
        llm.engine.speculative.propose = ScriptedDraft(llm.engine.speculative, script)
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if stats is not None:
        stats.update(llm.stats())
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return tokens


def exactness(root: Path, device: str, names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        if name == "smollm2-shape":
            CONFIGS[name] = SMOLLM2_SHAPE       # make_tiny_model reads its table
        folder, hf = make_tiny_model(name, root)
        add_tiny_tokenizer(folder)     # text only; ids past its vocab are fine
        hf = hf.to(device)
        prompts = random_prompts(8, [5, 17, 33, 64], hf.config.vocab_size, seed=1)
        ref = hf_tokens(hf, prompts, device)
        del hf
        eager = ours_tokens(folder, prompts, False, device)
        graph = ours_tokens(folder, prompts, True, device)
        row = {"model": name, "prompts": len(prompts),
               "eager_eq_hf": sum(a == b for a, b in zip(eager, ref, strict=True)),
               "graph_eq_hf": sum(a == b for a, b in zip(graph, ref, strict=True)),
               "graph_eq_eager": sum(a == b for a, b in zip(graph, eager, strict=True))}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


class ScriptedDraft:
    """The MTP's proposals replaced by a known continuation (prompt -> plain eager's
    tokens), each draft token wrong with probability 1/3 (seeded by prompt and position)."""

    def __init__(self, worker, script: dict):
        self.real, self.script = worker.propose, script

    def __call__(self, seqs, num_drafts):
        _, probs = self.real(seqs, num_drafts)      # the draft's K/V path still runs
        probs = torch.zeros_like(probs) if probs is not None else None
        drafts = []
        for i, (s, k) in enumerate(zip(seqs, num_drafts, strict=True)):
            n = s.num_output_tokens
            cont = self.script[tuple(s.prompt_token_ids)][n:n + k]
            cont = cont + [0] * (k - len(cont))
            rng = random.Random(n * 1000 + len(s.prompt_token_ids))
            d = [(t + 1) % 64 if rng.random() < 1 / 3 else t for t in cont]
            drafts.append(d)
            if probs is not None:
                probs[i, torch.arange(k), torch.tensor(d, dtype=torch.long)] = 1.0
        return drafts, probs


def mtp_check(root: Path, device: str, names: list[str]) -> list[dict]:
    from tests.tiny_mtp import with_mtp
    rows = []
    for name in names:
        base, hf = make_tiny_model(name, root)
        add_tiny_tokenizer(base)
        folder = with_mtp(base, root / f"{name}-mtp")
        prompts = random_prompts(8, [5, 17, 33, 64], hf.config.vocab_size, seed=1)
        del hf
        plain = ours_tokens(folder, prompts, False, device)      # MTP off
        script = {tuple(p): t for p, t in zip(prompts, plain, strict=True)}
        for draft, k, graph in itertools.product(("random", "scripted"), (1, 3), (False, True)):
            st: dict = {}
            toks = ours_tokens(folder, prompts, graph, device, stats=st,
                               script=script if draft == "scripted" else None,
                               speculative_method="mtp", num_speculative_tokens=k)
            row = {"model": name, "draft": draft, "k": k, "graph": graph,
                   "eq_plain_eager": sum(a == b for a, b in zip(toks, plain, strict=True)),
                   "acceptance_length": st.get("spec_acceptance_length"),
                   "accepted_per_position": st.get("spec_num_accepted_per_position"),
                   "proposed_per_position": st.get("spec_num_proposed_per_position"),
                   "graph_replays": st.get("graph_replays"),
                   "graph_fallbacks": st.get("graph_fallbacks")}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    ap.add_argument("--models", default=",".join([*CONFIGS, "smollm2-shape"]))
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--sections", default="exactness,timing,mtp,pd")
    ap.add_argument("--mtp-models", default="llama-tied-gqa,qwen2-gqa4,qwen3-qknorm-hd24")
    ap.add_argument("--pd-models", default=PD_MODELS)
    args = ap.parse_args()
    sections = args.sections.split(",")
    out = Path(args.out)
    print(torch.__version__, torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if "exactness" in sections:
            rows = exactness(Path(tmp), args.device, args.models.split(","))
            (out / "cuda_exactness.json").write_text(json.dumps(rows, indent=1))
        if "mtp" in sections:
            rows = mtp_check(Path(tmp), args.device, args.mtp_models.split(","))
            (out / "cuda_mtp.json").write_text(json.dumps(rows, indent=1))
        if "pd" in sections:
            rows = pd_check(Path(tmp), args.device, args.pd_models.split(","), hf_tokens,
                            MAX_NEW)
            (out / "cuda_pd.json").write_text(json.dumps(rows, indent=1))
        folder = Path(tmp) / "smollm2-shape"
        if "timing" in sections and folder.is_dir():
            subprocess.run([sys.executable, str(ROOT / "bench" / "graph_decode.py"),
                            "--device", args.device, "--dtype", "bfloat16", "--model", str(folder),
                            "--batches", args.batches, "--steps", "32",
                            "--json", str(out / "graph_decode_cuda.json")], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
