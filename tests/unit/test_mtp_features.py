"""The MTP training corpus and its features (tools/mtp_corpus.py, tools/mtp_features.py):
part 5 adds new (topic, style) requests without changing any other part, and features
are cached per part, so adding a part computes only that part's while every row still
lines up with its own sequence."""

from __future__ import annotations

import argparse

import pytest
import torch

import tools.mtp_features as features
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import add_tiny_tokenizer
from tools.mtp_corpus import CHAT, EXTRA_CHAT, EXTRA_TOPICS, MORE_CHAT, TOPICS, corpus_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _ = make_tiny_model("llama-tied-gqa", tmp_path_factory.mktemp("mtp-feat"))
    add_tiny_tokenizer(folder)
    from engine.tokenizer import Tokenizer
    return folder, Tokenizer(str(folder))


def test_part5_adds_new_requests_and_leaves_the_other_parts_alone(tiny):
    _, tok = tiny
    before, held, held_raw = corpus_prompts(tok, 0, len(TOPICS), 8, [1, 2, 3, 4], 10)
    after, held5, held_raw5 = corpus_prompts(tok, 0, len(TOPICS), 8, [1, 2, 3, 4, 5], 10)
    assert {k: after[k] for k in before} == before
    assert (held5, held_raw5) == (held, held_raw)
    assert not set(MORE_CHAT) & set(CHAT + EXTRA_CHAT)
    part5 = after[5]
    assert len(part5) == len(TOPICS + EXTRA_TOPICS) * len(MORE_CHAT)
    seen = {tuple(p) for k in (1, 2, 3) for p in before[k]} | {tuple(p) for p in held}
    assert len({tuple(p) for p in part5}) == len(part5)
    assert not seen & {tuple(p) for p in part5}


def _args(folder, tmp_path, parts, topk=4):
    return argparse.Namespace(
        model=str(folder), parts=parts, seed=0, num_topics=2, templates_per_topic=1,
        raw_count=3, max_new=5, gen_dtype="float32", gen_batch=64, feature_dtype="float32",
        feature_batch=4, seq_len=256, topk=topk, corpus_cache=str(tmp_path / "corpus.pt"),
        cache=str(tmp_path / "feat.pt"))


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
    toks, gen, hid, top_lp, top_id, _ = data
    assert hid.shape[:2] == toks.shape and hid.dtype == torch.bfloat16
    assert toks.shape[0] == gen.shape[0] == hid.shape[0] == top_id.shape[0] == 5 + 112
    # rows in order part 1, part 4, held out; each row is its own sequence
    seqs = [s for _, got, _ in features.corpus_parts(_args(folder, tmp_path, [1, 4]), tok)
            for s in got]
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
