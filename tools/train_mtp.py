"""Train an MTP draft head for a model by self-distillation from the model's own outputs.

No data is downloaded: the corpus is the model's own continuations, greedy but for part 8
(tools/mtp_corpus.py), generated with pdserve's engine in bfloat16 at batch 256, ignore_eos,
as the bench decodes, in nine parts (`corpus_prompts`, each cached on its own): chat
requests (1) 1,504 on 188 topics in 10 styles, (2) 2,638 on 151 more topics and 10 more
styles, (3) the 2,638 (topic, style) pairs not drawn yet; (4) 2,400 raw-text openings
without a chat template (tools/mtp_raw.py: code in 12 languages and forms, prose, lists,
dialogue, questions); (5) 3,390 chat requests: 10 more styles on all 339 topics; (6) 2,200
chat requests on 275 new topics, each in the bench's four styles and 4 more; (7) 1,956
requests and raw openings in 68 styles and 14 raw kinds the others lack (tools/mtp_broad.py,
a few dozen each); (8) 1,332 more of those and of the earlier styles, answers sampled
(temperature 0.8, top-p 0.95); (9) 4,000 requests and 1,000 raw openings the target samples
itself (tools/mtp_selfgen.py), none like a held-out style. Held out, for the agreement
printed after every epoch: 48 chat requests on 12 topics kept out of training and 64 raw
openings whose subjects and code tasks no training opening uses. Then, once per part: the
target's final hidden states h_t, the residual streams after the --aux-layers (what the
engine's target hands the draft) and its top-K next-token distributions at every position
are computed and kept (--cache, one file per part, rebuilt when the arguments change). Only
the head trains: at row t it sees (h_t and the aux layers' rows, x_{t+1}) and learns the
target's distribution at t+1, the prediction of x_{t+2}; unrolled steps 2 (and 3, with
--step3-weight) feed the head's own hidden state back with the next token, attending as the
engine's later draft steps do, and learn the distributions after it. The loss and the
held-out agreement count only rows whose input token is a generated one (that is where the
engine drafts), not the prompt or template.

The decoder layer starts as a copy of the target's last layer and shared_head.norm as its
final norm, or (--init) as a head trained before. The result is a small safetensors file
under DeepSeek-V3 keys (model.layers.{num_hidden_layers}.*) plus the draft vocabulary.

The shipped head was grown in stages, each continuing the one before with --init:
tools/mtp_recipe.py runs the whole chain from nothing (its docstring lists the stages
and their costs; docs/perf/HISTORY.md, "Speculative decoding (MTP)", has each stage's
measurements). The caches only skip regenerating the corpus / recomputing features on a rerun.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.loader import load_model  # noqa: E402
from engine.models.mtp import _FUSED, _PARTS, AUX_LAYERS_KEY, DRAFT_VOCAB_KEY, MTPModule  # noqa: E402
from tools.mtp_corpus import RAW_COUNT, TOPICS  # noqa: E402
from tools.mtp_features import (  # noqa: E402
    DenseCausal,
    large_blocks_from_mmap,
    load_or_build_features,
    residual_scale,
)


def init_from_target(mtp: MTPModule, model, scales: tuple[float, float]) -> None:
    """Start as the target's own last step: decoder layer = its last layer, shared_head.norm
    = its final norm, and eh_proj(hnorm(h)) = the residual stream h was normed from
    (hnorm undoes the final norm's weight), plus a little of the token embedding."""
    r_rms, h_rms = scales
    last = model.layers[-1]
    with torch.no_grad():
        mtp.layer.load_state_dict(last.state_dict())
        w_f = model.norm.weight
        mtp.shared_head_norm.weight.copy_(w_f)
        mtp.enorm.weight.fill_(1.0)
        safe = torch.where(w_f.abs() < 0.05, torch.full_like(w_f, 0.05).copysign(w_f), w_f)
        mtp.hnorm.weight.copy_(1.0 / safe)
        h = mtp.eh_proj.weight.shape[0]
        w = torch.randn(h, 2 * h) * 0.02
        w[:, h:] += r_rms * h_rms * torch.eye(h)
        w[:, :h] += 0.1 * r_rms * torch.eye(h)
        mtp.eh_proj.weight.copy_(w)
        if mtp.aux_proj is not None:        # the mid-layer features start switched off
            mtp.aux_proj.weight.zero_()


def load_head(mtp: MTPModule, path: str, prefix: str) -> None:
    """Weights of a head written by this script (DeepSeek-V3 keys under `prefix`)."""
    from safetensors.torch import load_file
    saved = load_file(path)
    names = mtp.hf_state_dict(prefix)
    state = {}
    for name, p in mtp.state_dict().items():
        top = name.split(".", 1)[0]
        if top != "layer":
            key = prefix + _PARTS[top][0] + name[len(top):]
            # a head without mid-layer features starts the projection at zero
            state[name] = (saved.get(key, torch.zeros_like(p)) if top == "aux_proj"
                           else saved[key])
            continue
        module, leaf = name[len("layer."):].rsplit(".", 1)
        keys = [f"{prefix}{part}.{leaf}" for part in _FUSED.get(module, (module,))]
        assert all(k in names for k in keys), keys
        state[name] = torch.cat([saved[k] for k in keys]).to(p.dtype)
    mtp.load_state_dict({k: v.float() for k, v in state.items()})


def draft_vocabulary(toks: torch.Tensor, mask: torch.Tensor, size: int, first_ids: int,
                     vocab_size: int) -> torch.Tensor:
    """Token ids the head may propose (sorted): the `first_ids` lowest ids (BPE merge order,
    roughly general frequency) and the corpus's `size` most frequent tokens. The head's LM
    head then costs a fraction of the full one."""
    counts = torch.bincount(toks[mask], minlength=vocab_size)
    top = counts.topk(min(size, vocab_size)).indices
    return torch.unique(torch.cat((torch.arange(min(first_ids, vocab_size)), top)))


def coverage(vocab: torch.Tensor, toks: torch.Tensor, mask: torch.Tensor) -> float:
    inside = torch.zeros(int(toks.max()) + 1 if toks.numel() else 1, dtype=torch.bool)
    inside[vocab[vocab < inside.numel()]] = True
    return inside[toks[mask]].float().mean().item()


def distill_loss(logits: torch.Tensor, lp: torch.Tensor, ids: torch.Tensor,
                 temp: float = 1.0) -> torch.Tensor:
    """Cross-entropy against the target's renormalised top-k distribution, sharpened by
    `temp` < 1 toward its argmax (greedy verify accepts the argmax only); near 0 it is
    the cross-entropy of the target's top-1 token."""
    student = torch.log_softmax(logits.float(), -1)
    p = torch.softmax(lp.float() / temp, -1)
    return -(p * student.gather(-1, ids.long())).sum(-1).mean()


def target_rows(data, b) -> torch.Tensor:
    """The target's rows for sequences `b` as the engine hands them to the draft: final
    hidden state, then the aux layers' residual streams (if the features hold any)."""
    hid, aux = data[2][b], data[5][b]
    return torch.cat((hid, aux), -1) if aux.shape[-1] else hid


def run_head(mtp: MTPModule, dense: DenseCausal, toks, rows, steps: int):
    """Draft step 1 and the unrolled steps 2 .. `steps` over a batch, every position (the
    head attends to the prompt too); returns the head's hidden states per step, T-1 rows
    a sequence. Step 1 starts from draft_input(target rows). Step m's row r sits at
    position r+m-1, is fed the head's own hidden state of step m-1 and the token
    x_{r+m}, and predicts x_{r+m+1}."""
    b, t = toks.shape
    n = t - 1
    dense.shape = (b, n)
    pos = torch.arange(n).repeat(b)
    xs, prev = [], mtp.draft_input(rows[:, :n].reshape(b * n, -1).float())
    for m in range(1, steps + 1):
        dense.mode = m
        # the last m-1 rows of a sequence have no token: they repeat the last one (masked)
        nxt = torch.cat([toks[:, m:]] + [toks[:, -1:]] * (m - 1), dim=1).reshape(-1)
        prev = mtp(nxt, prev, pos + (m - 1), None, None, None)
        xs.append(prev)
    return xs


def head_logits(mtp: MTPModule, x: torch.Tensor, vocab: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Logits over the whole vocabulary, or over `vocab` only (a sampled softmax)."""
    if vocab is None:
        return mtp.logits(x)
    w = mtp._shared[1].weight.index_select(0, vocab)
    return (mtp.shared_head_norm(x) @ w.t()).float()


def step_targets(gen, top_lp, top_id, steps: int):
    """Per draft step m: teacher log-probs, ids and row mask (row t -> the distribution at
    position t+m), T-1 rows per sequence. A row counts when the token it is fed (x_{t+m})
    is a generated one: that is when the engine drafts."""
    b, k = gen.shape[0], top_lp.shape[-1]
    out = []
    for m in range(1, steps + 1):
        lp = torch.cat([top_lp[:, m:]] + [top_lp[:, -1:]] * (m - 1), 1)
        ids = torch.cat([top_id[:, m:]] + [top_id[:, -1:]] * (m - 1), 1)
        mask = torch.cat((gen[:, m:], torch.zeros(b, m - 1, dtype=torch.bool)), 1)
        out.append((lp.reshape(-1, k), ids.reshape(-1, k), mask.reshape(-1)))
    return out


def evaluate(mtp, dense, data, idx, steps: int = 3) -> tuple[float, ...]:
    """Top-1 agreement with the target on generated positions of `idx`: draft step 1,
    then each later step counted only where every step before it agreed (as the engine
    accepts a chain), over the rows where the step before it agreed."""
    toks, gen, _, top_lp, top_id, _ = data
    hits, n = [0] * steps, 0
    with torch.no_grad():
        for i in range(0, len(idx), 4):
            b = idx[i:i + 4]
            xs = run_head(mtp, dense, toks[b], target_rows(data, b), steps)
            ok = None
            for m, (x, (_, ids, mask)) in enumerate(
                    zip(xs, step_targets(gen[b], top_lp[b], top_id[b], steps), strict=True)):
                hit = (head_logits(mtp, x).argmax(-1) == ids[:, 0].long()) & mask
                ok = hit if ok is None else ok & hit
                hits[m] += ok.sum().item()
                if m == 0:
                    n += mask.sum().item()
    return tuple(h / max(d, 1) for h, d in zip(hits, [n] + hits[:-1], strict=True))


def evaluate_sets(mtp, dense, data, held: dict[str, list[int]]) -> dict[str, tuple]:
    return {name: evaluate(mtp, dense, data, idx) for name, idx in held.items()}


def describe(scores: dict[str, tuple]) -> str:
    return "; ".join(f"{name}: step1 {a[0]:.3f} " + " ".join(
        f"step{j + 1}|{j} {x:.3f}" for j, x in enumerate(a[1:], 1))
        for name, a in scores.items())


def train(args, mtp, dense, data, n_train, vocab_size, rng, held: dict[str, list[int]]
          ) -> None:
    """AdamW, warm-up then cosine to 5% of the LR. The agreement on each held-out set is
    printed after every epoch and the head keeps the weights of the best epoch (by the
    sum of the sets' step-1 agreements)."""
    toks, gen, _, top_lp, top_id, _ = data
    # loss weight per draft step; trailing zero weights: those steps are not unrolled
    weights = [1.0, args.step2_weight, args.step3_weight]
    while weights[-1] == 0:
        weights.pop()
    best, best_state = -1.0, None
    opt = torch.optim.AdamW(mtp.parameters(), lr=args.lr, weight_decay=0.0)
    order = list(range(n_train))
    total = args.epochs * math.ceil(n_train / args.batch)
    warm = max(1, total // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.05 + 0.95 * 0.5 * (
            1 + math.cos(math.pi * min(s, total) / total))))
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16_train)
    bar = tqdm(total=total, desc="train mtp", unit="step")
    ema = None
    for epoch in range(args.epochs):
        rng.shuffle(order)
        for i in range(0, n_train, args.batch):
            b = order[i:i + args.batch]
            targets = step_targets(gen[b], top_lp[b], top_id[b], len(weights))
            sels = [mask.nonzero().squeeze(1) for _, _, mask in targets]
            # sampled softmax: the teachers' candidates plus random negatives
            vocab = torch.unique(torch.cat([ids[sel].reshape(-1).long() for (_, ids, _), sel
                                            in zip(targets, sels, strict=True)]
                                           + [torch.randint(0, vocab_size, (args.negatives,))]))
            remap = torch.zeros(vocab_size, dtype=torch.int64)
            remap[vocab] = torch.arange(vocab.numel())
            with amp:
                xs = run_head(mtp, dense, toks[b], target_rows(data, b), len(weights))
                losses = [distill_loss(head_logits(mtp, x[sel], vocab), lp[sel],
                                       remap[ids[sel].long()], args.teacher_temp)
                          for x, sel, (lp, ids, _) in zip(xs, sels, targets, strict=True)]
                l1 = losses[0]
                loss = sum(w * part for w, part in zip(weights, losses, strict=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.update(1)
            ema = l1.item() if ema is None else 0.98 * ema + 0.02 * l1.item()
            bar.set_postfix(loss1=f"{ema:.3f}")
        scores = evaluate_sets(mtp, dense, data, held)
        tqdm.write(f"epoch {epoch + 1}: held-out agreement {describe(scores)}")
        a1 = sum(a[0] for a in scores.values())
        if a1 > best:
            best, best_state = a1, {k: v.clone() for k, v in mtp.state_dict().items()}
    bar.close()
    mtp.load_state_dict(best_state)


def aux_layer_ids(spec: str, model_folder: str) -> list[int]:
    """--aux-layers as target layer ids."""
    if spec == "none":
        return []
    if spec != "auto":
        return [int(x) for x in spec.split(",") if x.strip()]
    from engine.models.model_config import ModelConfig
    n = ModelConfig.from_folder(model_folder).num_hidden_layers
    return sorted({n // 10, n // 2})


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target's HF folder")
    ap.add_argument("--out", required=True, help="safetensors file to write (bf16)")
    ap.add_argument("--num-topics", type=int, default=len(TOPICS))
    ap.add_argument("--templates-per-topic", type=int, default=8)
    ap.add_argument("--parts", type=lambda v: sorted({int(x) for x in v.split(",")}),
                    default=[1, 2, 3, 4, 5, 6], help="corpus parts to train on, of 1-10 "
                    "(tools/mtp_corpus.py corpus_prompts; 4 = raw-text openings; 9 and 10 = "
                    "prompts the target samples itself, tools/mtp_selfgen.py, 10's "
                    "answers sampled)")
    ap.add_argument("--raw-count", type=int, default=RAW_COUNT,
                    help="raw-text openings in part 4")
    ap.add_argument("--init", help="start from this head (safetensors) instead of the "
                                   "target's last layer")
    ap.add_argument("--features-only", action="store_true",
                    help="stop once the corpus and its features are built (and cached)")
    ap.add_argument("--max-new", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--gen-dtype", default="bfloat16", help="dtype the corpus is made in")
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--feature-dtype", default="bfloat16",
                    help="dtype of the target's forward that gives hidden states/teacher")
    ap.add_argument("--feature-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--topk", type=int, default=20, help="teacher distribution support")
    ap.add_argument("--aux-layers", default="auto",
                    help="target layers whose residual streams the head also reads "
                         "(EAGLE-3-style mid-layer features), comma-separated; auto: a "
                         "low and a middle one (n/10, n/2: 3,15 of 30); none: the final "
                         "hidden state only")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--bf16-train", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast for the head's training matmuls (weights stay fp32)")
    ap.add_argument("--step2-weight", type=float, default=0.5,
                    help="loss weight of the unrolled second draft step")
    ap.add_argument("--step3-weight", type=float, default=0.0,
                    help="loss weight of an unrolled third draft step (0: not unrolled)")
    ap.add_argument("--teacher-temp", type=float, default=1.0,
                    help="temperature of the target's distribution in the loss (< 1 sharpens)")
    ap.add_argument("--negatives", type=int, default=4096,
                    help="random vocabulary entries added to each step's sampled softmax")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="draft only the corpus's most frequent tokens (this many; 0: the "
                         "whole vocabulary) ...")
    ap.add_argument("--draft-vocab-first-ids", type=int, default=16384,
                    help="... and the tokenizer's lowest ids")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus-cache", help="keep the generated corpus here between runs (.pt)")
    ap.add_argument("--cache", help="keep the corpus features here between runs (.pt)")
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    large_blocks_from_mmap()
    if not args.teacher_temp > 0:
        ap.error(f"--teacher-temp must be > 0, got {args.teacher_temp}")
    args.aux_layers = aux_layer_ids(args.aux_layers, args.model)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t0 = time.time()

    from engine.tokenizer import Tokenizer
    tok = Tokenizer(args.model)
    data, n_train, n_chat = load_or_build_features(args, tok)
    toks, gen = data[:2]
    print(f"features ready: {n_train} training sequences, {int(gen[:n_train].sum())} "
          f"generated positions ({time.time() - t0:.0f}s)", flush=True)

    model, cfg = load_model(args.model, torch.float32, torch.device("cpu"))
    for p in model.parameters():
        p.requires_grad_(False)
    dense = DenseCausal(cfg.head_dim ** -0.5)
    mtp = MTPModule(cfg, model.embed_tokens, model.lm_head, dense,
                    aux_layers=tuple(args.aux_layers))
    if args.features_only:
        return 0
    if args.init:
        load_head(mtp, args.init, f"model.layers.{cfg.num_hidden_layers}.")
    else:
        init_from_target(mtp, model, residual_scale(model, toks[:2]))
    held = {"chat": list(range(n_train, n_train + n_chat)),
            "raw": list(range(n_train + n_chat, toks.shape[0]))}
    print("held-out top-1 agreement on generated positions before training: "
          f"{describe(evaluate_sets(mtp, dense, data, held))}", flush=True)
    t1 = time.time()
    if args.epochs:         # --epochs 0: only evaluate and write (e.g. another draft vocab)
        train(args, mtp, dense, data, n_train, cfg.vocab_size, rng, held)
    scores = evaluate_sets(mtp, dense, data, held)
    print(f"held-out top-1 agreement on generated positions after training: "
          f"{describe(scores)} (training {time.time() - t1:.0f}s)", flush=True)

    prefix = f"model.layers.{cfg.num_hidden_layers}."
    tensors = {k: v.detach().to(torch.bfloat16).contiguous()
               for k, v in mtp.hf_state_dict(prefix).items()}
    if args.aux_layers:
        tensors[prefix + AUX_LAYERS_KEY] = torch.tensor(args.aux_layers, dtype=torch.int64)
    if args.draft_vocab:
        vocab = draft_vocabulary(toks[:n_train], gen[:n_train], args.draft_vocab,
                                 args.draft_vocab_first_ids, cfg.vocab_size)
        tensors[prefix + DRAFT_VOCAB_KEY] = vocab
        print(f"draft vocabulary: {vocab.numel()} tokens, held-out coverage "
              f"{coverage(vocab, toks[n_train:], gen[n_train:]):.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pdserve-mtp", "target": Path(args.model).name,
            "num_hidden_layers": str(cfg.num_hidden_layers),
            **{f"heldout_{name}_top1_step{j + 1}": f"{a[j]:.4f}"
               for name, a in scores.items() for j in range(len(a))},
            "args": json.dumps(vars(args))}
    save_file(tensors, str(out), metadata=meta)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
