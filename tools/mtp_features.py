"""Target features for tools/train_mtp.py: the corpus (tools/mtp_corpus.py, generated
once per part and cached), and the target's final hidden states and top-K next-token
log-probs at every position, computed once with dense causal attention and cached; a
cache made from fewer corpus parts is extended with the new parts' rows."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.models.loader import load_model
from tools.mtp_corpus import corpus_prompts, generate_corpus


class DenseCausal:
    """Training attention over [B, T] rows (no paged cache). Mode 1 keeps step-1 K/V;
    mode 2 lets row r (position r+1) see step-1 keys at positions <= r and itself, which
    is exactly what the engine's second draft step sees."""

    def __init__(self, scale: float):
        self.scale, self.shape, self.mode, self.kv1 = scale, (0, 0), 1, None

    def __call__(self, q, k, v, k_cache, v_cache, meta):
        b, t = self.shape
        q4, k4, v4 = (x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        if self.mode == 1:
            self.kv1 = (k4, v4)
            o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=self.scale,
                                               enable_gqa=True)
        else:
            k1, v1 = self.kv1
            keys, vals = torch.cat((k1, k4), dim=2), torch.cat((v1, v4), dim=2)
            ar = torch.arange(t)
            mask = torch.cat((ar[None, :] <= ar[:, None], torch.eye(t, dtype=torch.bool)), 1)
            o = F.scaled_dot_product_attention(q4, keys, vals, attn_mask=mask,
                                               scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[2])


@torch.no_grad()
def target_features(model, seqs: list[tuple[list[int], int]], seq_len: int, topk: int,
                    batch: int):
    """Per sequence (padded to seq_len): tokens, the mask of generated positions (the
    answer, not the prompt or chat template), hidden [T, H] bf16 and the target's top-k
    next-token log-probs and ids at every position."""
    scale = model.config.head_dim ** -0.5
    dense = DenseCausal(scale)
    for layer in model.layers:
        layer.self_attn.backend = dense
    toks = torch.zeros(len(seqs), seq_len, dtype=torch.int64)
    gen = torch.zeros(len(seqs), seq_len, dtype=torch.bool)
    for i, (s, plen) in enumerate(seqs):
        s = s[:seq_len]
        toks[i, :len(s)] = torch.tensor(s)
        gen[i, plen:len(s)] = True
    hid = torch.zeros(len(seqs), seq_len, model.config.hidden_size, dtype=torch.bfloat16)
    top_lp = torch.zeros(len(seqs), seq_len, topk, dtype=torch.float16)
    top_id = torch.zeros(len(seqs), seq_len, topk, dtype=torch.int32)
    pos = torch.arange(seq_len).repeat(batch)
    for i in tqdm(range(0, len(seqs), batch), desc="target hidden states", unit="batch"):
        tb = toks[i:i + batch]
        b = tb.shape[0]
        dense.shape = (b, seq_len)
        h = model(tb.reshape(-1), pos[:b * seq_len], _NoCache(len(model.layers)), None)
        lp = torch.log_softmax(model.lm_head(h).float(), -1)
        v, ids = lp.topk(topk, -1)
        hid[i:i + b] = h.view(b, seq_len, -1).to(torch.bfloat16)
        top_lp[i:i + b] = v.view(b, seq_len, topk).half()
        top_id[i:i + b] = ids.view(b, seq_len, topk).int()
    return toks, gen, hid, top_lp, top_id


class _NoCache:
    def __init__(self, n: int):
        self.k = self.v = [None] * n


@torch.no_grad()
def residual_scale(model, toks: torch.Tensor) -> tuple[float, float]:
    """Median RMS of the residual stream entering the target's final norm (the scale its
    last layer works at) and of the final hidden states."""
    dense = model.layers[0].self_attn.backend
    dense.shape = tuple(toks.shape)
    seen = {}
    hook = model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("x", i[0]))
    h = model(toks.reshape(-1), torch.arange(toks.shape[1]).repeat(toks.shape[0]),
              _NoCache(len(model.layers)), None)
    hook.remove()
    rms = lambda t: t.pow(2).mean(-1).sqrt().median().item()  # noqa: E731
    return rms(seen["x"]), rms(h)


def build_corpus(args, tok) -> tuple[list[tuple[list[int], int]], int]:
    """(training sequences of every part, then the held-out ones; number of training
    sequences). Each part's answers are cached beside --corpus-cache (part 1 in that
    file with the held-out answers, part k > 1 in <stem>-part<k>.pt)."""
    parts, held = corpus_prompts(tok, args.seed, args.num_topics, args.templates_per_topic,
                                 args.corpus_parts)
    base = Path(args.corpus_cache) if args.corpus_cache else None
    train: list = []
    held_seqs: list = []
    for k, prompts in enumerate(parts, start=1):
        path = (None if base is None else
                base if k == 1 else base.with_name(f"{base.stem}-part{k}.pt"))
        if path is not None and path.is_file():
            got = torch.load(path)
        else:
            extra = held if k == 1 else []
            got = generate_corpus(args.model, prompts + extra, args.max_new,
                                  args.gen_dtype, args.gen_batch)
            got = (got, len(prompts)) if k == 1 else got
            if path is not None:
                torch.save(got, path)
        if k == 1:
            seqs1, n1 = got
            train += seqs1[:n1]
            held_seqs = seqs1[n1:]
        else:
            train += got
    return train + held_seqs, len(train)


def extend_features(args, model, seqs, n_train: int, cached, n_cached: int):
    """Features of a grown corpus from a cache of its first parts: the cached training
    rows, the new parts' rows computed at the cache's length, the cached held-out rows."""
    *old, scale = cached
    seq_len = old[0].shape[1]
    new = target_features(model, seqs[n_cached:n_train], seq_len, args.topk,
                          args.feature_batch)
    merged = [torch.cat((o[:n_cached], x, o[n_cached:])) for o, x in zip(old, new,
                                                                          strict=True)]
    return (*merged, scale)


def build_features(args, tok, cached=None, n_cached: int = 0):
    """(toks, gen, hid, top_lp, top_id, residual scales), number of training sequences."""
    seqs, n_train = build_corpus(args, tok)
    n_gen = sum(len(s) - p for s, p in seqs[:n_train])
    print(f"corpus: {n_train} training sequences ({n_gen} generated tokens, "
          f"{sum(len(s) for s, _ in seqs[:n_train])} in all), {len(seqs) - n_train} "
          "held out", flush=True)
    seq_len = min(args.seq_len, max(len(s) for s, _ in seqs))
    model, _ = load_model(args.model, getattr(torch, args.feature_dtype), torch.device("cpu"))
    if cached is not None:
        toks = cached[0]
        n_held = toks.shape[0] - n_cached
        if n_held != len(seqs) - n_train or not _same_rows(toks, seqs[:n_cached]
                                                           + seqs[n_train:]):
            raise ValueError("the feature cache does not hold this corpus's first parts")
        return extend_features(args, model, seqs, n_train, cached, n_cached), n_train
    data = target_features(model, seqs, seq_len, args.topk, args.feature_batch)
    model.float()
    return (*data, residual_scale(model, data[0][:2])), n_train


def _same_rows(toks: torch.Tensor, seqs) -> bool:
    return all(toks[i, :min(len(s), toks.shape[1])].tolist() == s[:toks.shape[1]]
               for i, (s, _) in enumerate(seqs))


def load_or_build_features(args, tok):
    """((toks, gen, hid, top_lp, top_id, residual scales), number of training sequences),
    from --cache when it holds this corpus, extended when it holds its first parts."""
    cache = Path(args.cache) if args.cache else None
    if cache is not None and cache.is_file():
        data, n_train = torch.load(cache)
        want = sum(len(p) for p in corpus_prompts(tok, args.seed, args.num_topics,
                                                  args.templates_per_topic,
                                                  args.corpus_parts)[0])
        if n_train == want:
            return data, n_train
        data, n_train = build_features(args, tok, data, n_train)   # fewer parts cached
    else:
        data, n_train = build_features(args, tok)
    if cache is not None:
        torch.save((data, n_train), cache)
    return data, n_train
