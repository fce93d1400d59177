"""Where the engine's MTP acceptance stands against the head's teacher-forced agreement.

Decodes a held-out set (bench/spec_decode.py's sets) greedily with MTP k=1 in float32,
recording every draft (the sequence's length when it drafted and the token), then runs the
target and the head densely over the finished sequences (teacher forcing: the head at row
t sees the target's h_t and x_{t+1}, as the engine's first draft step does) and prints

- how often the engine's draft equals the teacher-forced prediction at the same position
  (1.0 when each step drafts from the newest verified hidden state with the draft K/V of
  every verified position; float noise between paged and dense attention aside);
- the teacher-forced agreement over every generated position, and over the positions the
  engine drafted (which is what the engine's acceptance measures).

    .venv/bin/python tools/mtp_positions.py [--set raw] [--prompts 32] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.spec_decode import prompt_sets  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from tools.mtp_features import DenseCausal, _NoCache  # noqa: E402


def record_drafts(llm: LLM) -> dict[tuple[int, ...], dict[int, int]]:
    """{prompt tokens: {position drafted: draft token}} for a k=1 engine."""
    worker, seen = llm.engine.speculative, {}
    real = worker.propose

    def propose(seqs, num_drafts):
        drafts, probs = real(seqs, num_drafts)
        for s, d in zip(seqs, drafts, strict=True):
            if d:
                seen.setdefault(tuple(s.prompt_token_ids), {})[len(s)] = d[0]
        return drafts, probs
    worker.propose = propose
    return seen


@torch.inference_mode()
def teacher_forced(llm: LLM, tokens: list[int]) -> list[int]:
    """The head's prediction of x_{t+2} from (h_t, x_{t+1}) for every t (dense, float32)."""
    model, draft = llm.engine.model, llm.engine.speculative.draft
    dense = DenseCausal(model.config.head_dim ** -0.5)
    saved = [layer.self_attn.backend for layer in model.layers] + [draft.layer.self_attn.backend]
    saved_attention, model.attention = model.attention, dense
    for layer in model.layers:
        layer.self_attn.backend = dense
    draft.layer.self_attn.backend = dense
    try:
        n = len(tokens)
        toks = torch.tensor(tokens)
        dense.shape = (1, n)
        h = model(toks, torch.arange(n), _NoCache(len(model.layers)), None)
        dense.shape, dense.mode = (1, n - 1), 1
        x = draft(toks[1:], h[:-1], torch.arange(n - 1), None, None, None)
        return draft.logits(x).argmax(-1).tolist()
    finally:
        model.attention = saved_attention
        for layer, b in zip([*model.layers, draft.layer], saved, strict=True):
            layer.self_attn.backend = b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--set", default="chat", choices=("chat", "raw"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        folder = Path(args.model)
    else:
        from launch.default_model import prepare_default_model
        folder = prepare_default_model()
    llm = LLM(folder, dtype="float32", max_num_seqs=args.prompts, speculative_method="mtp",
              num_speculative_tokens=1)
    prompts = prompt_sets(llm.tokenizer, [args.set])[args.set][:args.prompts]
    seen = record_drafts(llm)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    st = llm.stats()
    same = hit_drafted = n_drafted = hit_all = n_all = 0
    for out in outs:
        drafted = seen.get(tuple(out.prompt_token_ids), {})
        full = out.prompt_token_ids + out.outputs[0].token_ids
        plen = len(out.prompt_token_ids)
        pred = teacher_forced(llm, full)          # pred[t] predicts full[t + 2]
        for pos in range(plen + 1, len(full)):    # positions whose input token is generated
            ok = pred[pos - 2] == full[pos]
            hit_all += ok
            n_all += 1
            if pos in drafted:
                n_drafted += 1
                hit_drafted += ok
                same += drafted[pos] == pred[pos - 2]
    print(f"{args.set}: {len(outs)} prompts x {args.max_tokens} tokens, MTP k=1 float32")
    print(f"engine acceptance rate {st['spec_acceptance_rate_per_position'][0]:.4f} "
          f"({st['spec_num_accepted_tokens']} / {st['spec_num_drafts']} drafts)")
    print(f"engine draft == teacher-forced prediction at the same position: "
          f"{same} / {n_drafted}")
    print(f"teacher-forced agreement: drafted positions {hit_drafted / n_drafted:.4f} "
          f"({n_drafted}), every generated position {hit_all / n_all:.4f} ({n_all})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
