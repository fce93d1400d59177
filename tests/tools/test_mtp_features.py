"""The MTP training corpus and its features (tools/mtp_corpus.py, tools/mtp_features.py):
part 5 adds new (topic, style) requests without changing any other part, and features
are cached per part, so adding a part computes only that part's while every row still
lines up with its own sequence."""

from __future__ import annotations

import argparse

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tools.mtp_features as features
from tools.mtp_corpus import (
    CHAT,
    EXTRA_CHAT,
    EXTRA_TOPICS,
    HELD_OUT_CHAT,
    HELD_OUT_TOPICS,
    MORE_CHAT,
    NEW_TOPICS,
    TOPICS,
    corpus_prompts,
    encode_request,
)


def _new_part(tok, earlier: list[int], part: int) -> list[list[int]]:
    """Part `part`, drawn beside the `earlier` parts: those and the held-out sets come out
    the same with it or without it, and its requests are distinct and new."""
    before, held, held_raw = corpus_prompts(tok, 0, len(TOPICS), 8, earlier, 10)
    after, held2, held_raw2 = corpus_prompts(tok, 0, len(TOPICS), 8, earlier + [part], 10)
    assert {k: after[k] for k in before} == before
    assert (held2, held_raw2) == (held, held_raw)
    added = {tuple(p) for p in after[part]}
    assert len(added) == len(after[part])
    seen = {tuple(p) for k in before for p in before[k]} | {tuple(p) for p in held}
    assert not seen & added
    return after[part]


def test_part5_adds_new_requests_and_leaves_the_other_parts_alone(tiny):
    _, tok = tiny
    assert not set(MORE_CHAT) & set(CHAT + EXTRA_CHAT)
    part5 = _new_part(tok, [1, 2, 3, 4], 5)
    assert len(part5) == len(TOPICS + EXTRA_TOPICS) * len(MORE_CHAT)


def test_part6_asks_new_topics_in_the_bench_styles_and_leaves_the_rest_alone(tiny):
    from bench.spec_decode import TOPICS as BENCH_TOPICS
    _, tok = tiny
    named = {t.lower() for t in NEW_TOPICS}
    assert not named & {t.lower() for t in TOPICS + EXTRA_TOPICS + HELD_OUT_TOPICS
                        + BENCH_TOPICS}
    part6 = _new_part(tok, [1, 2, 3, 5], 6)
    assert len(part6) == len(NEW_TOPICS) * (len(HELD_OUT_CHAT) + 4)
    # every new topic in each of the bench's request styles
    asks = {tuple(encode_request(tok, a.format(t=NEW_TOPICS[0]))) for a in HELD_OUT_CHAT}
    assert asks <= {tuple(p) for p in part6}


def _args(folder, tmp_path, parts, topk=4):
    return argparse.Namespace(
        model=str(folder), parts=parts, seed=0, num_topics=2, templates_per_topic=1,
        raw_count=3, max_new=5, gen_dtype="float32", gen_batch=64, feature_dtype="float32",
        feature_batch=4, seq_len=256, topk=topk, corpus_cache=str(tmp_path / "corpus.pt"),
        cache=str(tmp_path / "feat.pt"), aux_layers=[0])


def _count_features(monkeypatch) -> list[int]:
    computed: list[int] = []
    real = features.target_features

    def counting(model, seqs, *a):
        computed.append(len(seqs))
        return real(model, seqs, *a)
    monkeypatch.setattr(features, "target_features", counting)
    return computed


def test_features_are_cached_per_part_and_rows_match_their_sequences(tiny, tmp_path,
                                                                     monkeypatch):
    folder, tok = tiny
    computed = _count_features(monkeypatch)
    (toks, gen, *_), n_train, n_chat = features.load_or_build_features(
        _args(folder, tmp_path, [1]), tok)
    assert computed == [2, 48 + 64]           # part 1 (2 topics x 1), then the held-out sets
    assert (n_train, n_chat) == (2, 48)
    computed.clear()
    data, n_train, n_chat = features.load_or_build_features(
        _args(folder, tmp_path, [1, 4]), tok)
    assert computed == [3]                    # only part 4's 3 openings are new
    assert (n_train, n_chat) == (5, 48)
    toks, gen, hid, top_lp, top_id, aux = data
    assert hid.shape[:2] == toks.shape and hid.dtype == torch.bfloat16
    assert aux.shape == hid.shape and aux.dtype == torch.bfloat16     # one aux layer
    assert toks.shape[0] == gen.shape[0] == hid.shape[0] == top_id.shape[0] == 5 + 112
    # rows in order part 1, part 4, held out; each row is its own sequence
    parts, _ = features.corpus_parts(_args(folder, tmp_path, [1, 4]), tok)
    seqs = [s for _, got in parts for s in got]
    for i, (s, plen) in enumerate(seqs):
        assert toks[i, :len(s)].tolist() == s
        assert gen[i].nonzero().squeeze(1).tolist() == list(range(plen, len(s)))
        assert not gen[i, len(s):].any()
        # the corpus is the target's greedy output (float32), so the teacher's top-1 at
        # t-1 is the generated token at t
        assert top_id[i, plen - 1:len(s) - 1, 0].tolist() == s[plen:]
    assert (top_lp[:, :, 0] >= top_lp[:, :, 1]).all()


def test_a_part_cache_from_other_arguments_is_rebuilt(tiny, tmp_path, monkeypatch):
    folder, tok = tiny
    computed = _count_features(monkeypatch)
    features.load_or_build_features(_args(folder, tmp_path, [1]), tok)
    computed.clear()
    data, _, _ = features.load_or_build_features(_args(folder, tmp_path, [1], topk=6), tok)
    assert computed == [2, 112]
    assert data[4].shape[-1] == 6


def test_unrolled_step_attention_sees_what_the_engine_draft_sees():
    """Step m's row r (position r+m-1) attends to step-1 keys at positions <= r (the
    verified positions' draft K/V), its own row's keys of steps 2 .. m-1 (written by this
    draft chain) and itself; checked against one explicit softmax per row."""
    torch.manual_seed(0)
    b, t, heads, kv_heads, d = 2, 5, 4, 2, 8
    dense = features.DenseCausal(d ** -0.5)
    dense.shape = (b, t)
    steps = [tuple(torch.randn(b * t, n, d) for n in (heads, kv_heads, kv_heads))
             for _ in range(3)]
    for m, (q, k, v) in enumerate(steps, 1):
        dense.mode = m
        got = dense(q, k, v, None, None, None).view(b, t, heads, d)
        for s in range(b):
            for r in range(t):
                keys = [steps[0][1].view(b, t, kv_heads, d)[s, :r + 1]]
                vals = [steps[0][2].view(b, t, kv_heads, d)[s, :r + 1]]
                for j in range(1, m):
                    keys.append(steps[j][1].view(b, t, kv_heads, d)[s, r:r + 1])
                    vals.append(steps[j][2].view(b, t, kv_heads, d)[s, r:r + 1])
                kk = torch.cat(keys).repeat_interleave(heads // kv_heads, 1)   # [n, H, d]
                vv = torch.cat(vals).repeat_interleave(heads // kv_heads, 1)
                qq = q.view(b, t, heads, d)[s, r]                               # [H, d]
                w = torch.softmax(torch.einsum("hd,nhd->hn", qq, kk) * d ** -0.5, -1)
                want = torch.einsum("hn,nhd->hd", w, vv)
                torch.testing.assert_close(got[s, r], want, rtol=1e-5, atol=1e-5)


def test_train_mtp_end_to_end_with_three_unrolled_steps(tiny, tmp_path, monkeypatch):
    """tools/train_mtp.py from corpus to a head the engine loads, with a third unrolled
    step: held-out agreement is reported for every step and the head carries its draft
    vocabulary."""
    import sys

    from safetensors import safe_open

    import tools.train_mtp as train_mtp
    from engine.models.loader import load_model
    from engine.models.mtp import head_aux_layers, load_mtp
    folder, _ = tiny
    out = tmp_path / "draft" / "head.safetensors"
    monkeypatch.setattr(sys, "argv", [
        "train_mtp", "--model", str(folder), "--out", str(out), "--parts", "1",
        "--num-topics", "2", "--templates-per-topic", "2", "--raw-count", "3",
        "--max-new", "6", "--gen-dtype", "float32", "--feature-dtype", "float32",
        "--topk", "4", "--epochs", "2", "--batch", "2", "--negatives", "16",
        "--draft-vocab", "40", "--draft-vocab-first-ids", "64", "--step3-weight", "0.5",
        "--aux-layers", "0",
        "--corpus-cache", str(tmp_path / "corpus.pt"), "--cache", str(tmp_path / "f.pt")])
    threads = torch.get_num_threads()
    try:
        assert train_mtp.main() == 0
    finally:
        torch.set_num_threads(threads)      # main() sets the process's thread count
    meta = safe_open(str(out), "pt").metadata()
    for name in ("chat", "raw"):
        for step in (1, 2, 3):
            assert 0.0 <= float(meta[f"heldout_{name}_top1_step{step}"]) <= 1.0
    model, _ = load_model(str(folder), torch.float32, torch.device("cpu"))
    model.set_aux_layers(head_aux_layers(folder, 2, out.parent))
    mtp = load_mtp(folder, model, torch.float32, torch.device("cpu"), draft_folder=out.parent)
    assert mtp.draft_vocab is not None and 64 <= mtp.draft_vocab.numel() <= 104
    assert mtp.aux_layers == (0,) and mtp.aux_proj.weight.abs().sum() > 0


def test_a_head_without_aux_layers_continues_with_the_projection_at_zero(tiny, tmp_path):
    """--init from a head that reads only the final hidden state: the new head starts as
    exactly that head (aux_proj zero), so training continues from where it was."""
    from safetensors.torch import save_file

    from engine.models.loader import load_model
    from engine.models.mtp import MTPModule
    from tests.tiny_mtp import random_mtp_tensors
    from tools.train_mtp import load_head
    folder, _ = tiny
    prefix = "model.layers.2."
    save_file({k: v.contiguous() for k, v in random_mtp_tensors(folder, prefix).items()},
              str(tmp_path / "plain.safetensors"))
    model, cfg = load_model(str(folder), torch.float32, torch.device("cpu"))
    plain = MTPModule(cfg, model.embed_tokens, model.lm_head)
    aux = MTPModule(cfg, model.embed_tokens, model.lm_head, aux_layers=(0,))
    with torch.no_grad():
        aux.aux_proj.weight.fill_(1.0)
    load_head(plain, str(tmp_path / "plain.safetensors"), prefix)
    load_head(aux, str(tmp_path / "plain.safetensors"), prefix)
    assert not aux.aux_proj.weight.any()
    for name, p in plain.state_dict().items():
        assert torch.equal(aux.state_dict()[name], p), name


def test_a_low_teacher_temperature_is_the_cross_entropy_of_the_target_top1():
    """--teacher-temp: 1 keeps the soft top-k target, near 0 it is plain cross-entropy
    against the target's argmax (whatever the teacher's order of candidates)."""
    from tools.train_mtp import distill_loss
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9, generator=g)
    lp = torch.log_softmax(torch.randn(5, 4, generator=g), -1)
    ids = torch.stack([torch.randperm(9, generator=g)[:4] for _ in range(5)])
    top = ids.gather(1, lp.argmax(1, keepdim=True)).squeeze(1)
    hard = torch.nn.functional.cross_entropy(logits, top)
    soft = -(lp.exp() / lp.exp().sum(-1, keepdim=True)
             * torch.log_softmax(logits, -1).gather(1, ids)).sum(-1).mean()
    assert torch.allclose(distill_loss(logits, lp, ids), soft, atol=1e-6)
    assert torch.allclose(distill_loss(logits, lp, ids, temp=1e-3), hard, atol=1e-5)
    assert not torch.allclose(soft, hard, atol=1e-3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6)), min_size=1, max_size=5),
       st.integers(0, 3))
def test_parts_stack_padded_with_zeros_past_each_parts_length(shapes, extra):
    """Each part's rows land in order, its columns first, zeros after, to the longest
    part's length (or more): what the torch.cat of padded copies it replaced gave."""
    g = torch.Generator().manual_seed(len(shapes) * 7 + extra)
    parts = [torch.randn(n, length, 3, generator=g).bfloat16() for n, length in shapes]
    length = max(t.shape[1] for t in parts) + extra
    got = features._cat_padded(parts, length)
    assert got.shape == (sum(n for n, _ in shapes), length, 3) and got.dtype == torch.bfloat16
    row = 0
    for t in parts:
        block = got[row:row + t.shape[0]]
        assert torch.equal(block[:, :t.shape[1]], t)
        assert not block[:, t.shape[1]:].any()
        row += t.shape[0]
