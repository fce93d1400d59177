"""Target features for tools/train_mtp.py: the corpus (tools/mtp_corpus.py, generated
once per part and cached), and the target's final hidden states, the residual streams
after the head's aux layers (if any) and top-K next-token log-probs at every position,
computed once with dense causal attention and cached per part (each part's cache
remembers the arguments it was made from)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.models.loader import load_model
from tools.mtp_corpus import (
    SAMPLED_PARTS,
    SELF_PARTS,
    corpus_prompts,
    encode_request,
    generate_corpus,
)


class DenseCausal:
    """Training attention over [B, T] rows (no paged cache), for unrolled draft steps.
    Mode 1 is causal and keeps its K/V; in mode m > 1, row r (position r+m-1) sees step-1
    keys at positions <= r, the keys of its own row at steps 2 .. m-1, and itself, which
    is exactly what the engine's m-th draft step sees (the draft cache holds the verified
    positions' K/V, the earlier steps of this chain wrote theirs after them)."""

    def __init__(self, scale: float):
        self.scale, self.shape, self.mode, self.kvs = scale, (0, 0), 1, []

    def prepare(self, meta, k_cache):
        """The model's once-per-forward plan: nothing to plan for dense attention."""
        return meta

    def __call__(self, q, k, v, k_cache, v_cache, meta):
        b, t = self.shape
        q4, k4, v4 = (x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        if self.mode == 1:
            self.kvs = [(k4, v4)]
            o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=self.scale,
                                               enable_gqa=True)
        else:
            self.kvs = self.kvs[:self.mode - 1] + [(k4, v4)]
            keys = torch.cat([kv[0] for kv in self.kvs], dim=2)
            vals = torch.cat([kv[1] for kv in self.kvs], dim=2)
            ar = torch.arange(t)
            eye = torch.eye(t, dtype=torch.bool)
            mask = torch.cat([ar[None, :] <= ar[:, None]] + [eye] * (self.mode - 1), 1)
            o = F.scaled_dot_product_attention(q4, keys, vals, attn_mask=mask,
                                               scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[2])


@torch.no_grad()
def target_features(model, seqs: list[tuple[list[int], int]], seq_len: int, topk: int,
                    batch: int, aux_layers: tuple[int, ...] = ()):
    """Per sequence (padded to seq_len): tokens, the mask of generated positions (the
    answer, not the prompt or chat template), hidden [T, H] bf16, the target's top-k
    next-token log-probs and ids at every position, and the residual streams after
    `aux_layers` [T, len(aux_layers) * H] bf16, as the engine's target returns them."""
    scale = model.config.head_dim ** -0.5
    model.set_aux_layers(aux_layers)
    width = model.config.hidden_size
    dense = DenseCausal(scale)
    model.attention = dense
    for layer in model.layers:
        layer.self_attn.backend = dense
    toks = torch.zeros(len(seqs), seq_len, dtype=torch.int64)
    gen = torch.zeros(len(seqs), seq_len, dtype=torch.bool)
    for i, (s, plen) in enumerate(seqs):
        s = s[:seq_len]
        toks[i, :len(s)] = torch.tensor(s)
        gen[i, plen:len(s)] = True
    hid = torch.zeros(len(seqs), seq_len, width, dtype=torch.bfloat16)
    aux = torch.zeros(len(seqs), seq_len, model.output_width - width, dtype=torch.bfloat16)
    top_lp = torch.zeros(len(seqs), seq_len, topk, dtype=torch.float16)
    top_id = torch.zeros(len(seqs), seq_len, topk, dtype=torch.int32)
    pos = torch.arange(seq_len).repeat(batch)
    for i in tqdm(range(0, len(seqs), batch), desc="target hidden states", unit="batch"):
        tb = toks[i:i + batch]
        b = tb.shape[0]
        dense.shape = (b, seq_len)
        rows = model(tb.reshape(-1), pos[:b * seq_len], _NoCache(len(model.layers)), None)
        h = rows[:, :width]
        lp = torch.log_softmax(model.lm_head(h).float(), -1)
        v, ids = lp.topk(topk, -1)
        hid[i:i + b] = h.view(b, seq_len, -1).to(torch.bfloat16)
        aux[i:i + b] = rows[:, width:].reshape(b, seq_len, -1).to(torch.bfloat16)
        top_lp[i:i + b] = v.view(b, seq_len, topk).half()
        top_id[i:i + b] = ids.view(b, seq_len, topk).int()
    model.set_aux_layers(())
    return toks, gen, hid, top_lp, top_id, aux


class _NoCache:
    def __init__(self, n: int):
        self.k = self.v = [None] * n


@torch.no_grad()
def residual_scale(model, toks: torch.Tensor) -> tuple[float, float]:
    """Median RMS of the residual stream entering the target's final norm (the scale its
    last layer works at) and of the final hidden states. `model`: a float32 load (a bf16
    load may hold its weights prepacked for oneDNN, which .float() does not convert)."""
    dense = DenseCausal(model.config.head_dim ** -0.5)
    model.attention = dense
    for layer in model.layers:
        layer.self_attn.backend = dense
    dense.shape = tuple(toks.shape)
    seen = {}
    hook = model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("x", i[0]))
    h = model(toks.reshape(-1), torch.arange(toks.shape[1]).repeat(toks.shape[0]),
              _NoCache(len(model.layers)), None)
    hook.remove()
    rms = lambda t: t.pow(2).mean(-1).sqrt().median().item()  # noqa: E731
    return rms(seen["x"]), rms(h)


def _part_path(cache: str | None, name: str) -> Path | None:
    """Where part `name` of a cache lives: beside `cache`, as <stem>-<name>.pt."""
    if not cache:
        return None
    base = Path(cache)
    return base.with_name(f"{base.stem}-{name}.pt")


def corpus_parts(args, tok) -> tuple[list[tuple[str, list[tuple[list[int], int]]]], int]:
    """([(name, sequences)] for each training part asked for, then the held-out sets
    ("held": the chat ones, then the raw-text ones); number of held-out chat sequences).
    Each part's answers are cached beside --corpus-cache (part k in <stem>-part<k>.pt, the
    held-out sets in <stem>-held.pt)."""
    parts, held_chat, held_raw = corpus_prompts(tok, args.seed, args.num_topics,
                                                args.templates_per_topic,
                                                [k for k in args.parts
                                                 if k not in SELF_PARTS], args.raw_count)
    for k in SELF_PARTS:
        if k in args.parts:
            parts[k] = self_generated_prompts(args, tok, k)
    parts = dict(sorted(parts.items()))
    out = []
    named = [(f"part{k}", p) for k, p in parts.items()] + [("held", held_chat + held_raw)]
    for name, prompts in named:
        path = _part_path(args.corpus_cache, name)
        if path is not None and path.is_file():
            got = torch.load(path)
        else:
            part = int(name[4:]) if name.startswith("part") else None
            got = generate_corpus(args.model, prompts, args.max_new, args.gen_dtype,
                                  args.gen_batch, SAMPLED_PARTS.get(part),
                                  args.seed + 1000 * (part or 0))
            if path is not None:
                torch.save(got, path)
        if [s[:p] for s, p in got] != prompts:
            raise ValueError(f"the corpus cache {path} does not hold these prompts")
        out.append((name, got))
    return out, len(held_chat)


def self_generated_prompts(args, tok, part: int) -> list[list[int]]:
    """A self-generated part's prompts (tools/mtp_selfgen.py; part 9 or 10): sampled from
    the target once, seeded by the part's number, and kept as text beside --corpus-cache
    (<stem>-part<k>-prompts.json), so a rerun asks the same."""
    from tools.mtp_selfgen import self_generated
    path = _part_path(args.corpus_cache, f"part{part}-prompts")
    path = path.with_suffix(".json") if path is not None else None
    if path is not None and path.is_file():
        got = json.loads(path.read_text())
    else:
        requests, raw = self_generated(args.model, tok, args.seed + 1000 * part)
        got = {"requests": requests, "raw": raw}
        if path is not None:
            path.write_text(json.dumps(got, indent=0, ensure_ascii=False))
    return ([encode_request(tok, r) for r in got["requests"]]
            + [tok.encode(t) for t in got["raw"]])


def cache_key(args, name: str, n: int) -> dict:
    """What one part's feature cache was made from; a cache with another key is rebuilt."""
    key = {k: getattr(args, k) for k in ("seed", "num_topics", "templates_per_topic",
                                         "raw_count", "max_new", "gen_dtype",
                                         "feature_dtype", "seq_len", "topk",
                                         "aux_layers")}
    return {**key, "part": name, "sequences": n}


def _cat_padded(parts: list[torch.Tensor], length: int) -> torch.Tensor:
    """The parts stacked along dim 0, dim 1 padded with zeros to `length` (padding rows are
    outside the generated mask), copied into one tensor allocated once: a torch.cat of
    padded copies held every part twice (parts 7-10 are ~11 GB, on a 24 GB machine)."""
    n = sum(t.shape[0] for t in parts)
    out = torch.zeros(n, length, *parts[0].shape[2:], dtype=parts[0].dtype)
    row = 0
    for t in parts:
        out[row:row + t.shape[0], :t.shape[1]] = t
        row += t.shape[0]
    return out


def load_or_build_features(args, tok):
    """((toks, gen, hid, top_lp, top_id, aux), number of training sequences,
    number of held-out chat sequences; the held-out raw-text ones follow them). Each
    part's features are kept beside --cache (<stem>-<part>.pt), so adding a part computes
    only that part's."""
    model, pieces, n_train = None, [], 0
    parts, n_chat = corpus_parts(args, tok)
    for name, seqs in parts:
        key = cache_key(args, name, len(seqs))
        path = _part_path(args.cache, name)
        # mapped, not read: each part's pages are read once, by the copy into the result
        got = torch.load(path, mmap=True) if path is not None and path.is_file() else None
        if got is not None and got.get("key") != key:
            print(f"{path} was made from other arguments: rebuilding", flush=True)
            got = None
        if got is None:
            n_gen = sum(len(s) - p for s, p in seqs)
            print(f"{name}: {len(seqs)} sequences, {n_gen} generated tokens", flush=True)
            if model is None:
                model, _ = load_model(args.model, getattr(torch, args.feature_dtype),
                                      torch.device("cpu"))
            seq_len = min(args.seq_len, max(len(s) for s, _ in seqs))
            got = {"key": key, "data": target_features(model, seqs, seq_len, args.topk,
                                                        args.feature_batch,
                                                        tuple(args.aux_layers))}
            if path is not None:
                torch.save(got, path)
        pieces.append(got["data"])
        if name != "held":
            n_train += len(seqs)
    length = max(p[0].shape[1] for p in pieces)
    data = tuple(_cat_padded([p[i] for p in pieces], length) for i in range(6))
    return data, n_train, n_chat


def large_blocks_from_mmap() -> None:
    """Allocations of 1 MB and more straight from mmap, given back when freed. Training's
    per-step tensors change shape every batch (sequence lengths, the sampled vocabulary),
    and from glibc's heap their holes grew the process from 14 to 24 GB in ~900 steps over
    parts 7-10's 11 GB of features (swap-less: the machine stalled). Same as
    MALLOC_MMAP_THRESHOLD_=1048576; a no-op off glibc."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)       # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)       # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass
