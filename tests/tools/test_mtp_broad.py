"""Parts 7 and 8 of the MTP corpus (tools/mtp_broad.py, issue 39): many styles at small
counts. Part 7 asks every new style and raw kind on training topics only, new requests that
leave the other parts alone; part 8 asks them again with the earlier styles and its
answers are sampled, reproducibly per seed, while part 7's stay greedy."""

from __future__ import annotations

import argparse

import torch

import tools.mtp_corpus as corpus
import tools.mtp_features as features
from tools.mtp_broad import RAW_KINDS, TOPIC_STYLES, WORD_STYLES, broad_texts

TRAIN_TOPICS = corpus.TOPICS + corpus.EXTRA_TOPICS + corpus.NEW_TOPICS



def test_new_styles_are_not_the_earlier_ones_and_many():
    earlier = set(corpus.CHAT + corpus.EXTRA_CHAT + corpus.MORE_CHAT)
    assert len(TOPIC_STYLES) + len(WORD_STYLES) >= 2 * len(earlier)
    assert not earlier & set(TOPIC_STYLES)
    assert len(set(TOPIC_STYLES)) == len(TOPIC_STYLES)
    assert len(RAW_KINDS) >= 12


def test_broad_texts_ask_every_style_and_kind_at_the_counts_given():
    per_style, per_word, per_raw = 3, 2, 4
    chat, raw = broad_texts(5, TRAIN_TOPICS, per_style, per_word, per_raw)
    assert len(chat) == len(set(chat)) == (len(TOPIC_STYLES) * per_style
                                          + len(WORD_STYLES) * per_word)
    for style in TOPIC_STYLES:
        head = style.split("{t}")[0]
        asked = [c for c in chat if c.startswith(head) and c.endswith(style.split("{t}")[1])]
        assert len(asked) >= per_style, style
    assert len(raw) == len(set(raw)) == sum(len(t) for t in RAW_KINDS.values()) * per_raw // 2
    for kind, tmpls in RAW_KINDS.items():
        starts = [t.split("{")[0] for t in tmpls]
        assert any(r.startswith(s) for r in raw for s in starts), kind
    assert broad_texts(5, TRAIN_TOPICS, per_style, per_word, per_raw) == (chat, raw)
    assert broad_texts(6, TRAIN_TOPICS, per_style, per_word, per_raw) != (chat, raw)


def test_held_out_topics_are_never_asked():
    chat, _ = broad_texts(7, TRAIN_TOPICS, *corpus.BROAD_COUNTS[7])
    held = [t.lower() for t in corpus.HELD_OUT_TOPICS]
    assert not [c for c in chat if any(h in c.lower() for h in held)]


def test_part7_is_new_and_part8_adds_the_earlier_styles(tiny):
    _, tok = tiny
    before, held, held_raw = corpus.corpus_prompts(tok, 0, len(corpus.TOPICS), 8,
                                                   [1, 2, 3, 4, 5, 6], 10)
    after, held2, held_raw2 = corpus.corpus_prompts(tok, 0, len(corpus.TOPICS), 8,
                                                    [1, 2, 3, 4, 5, 6, 7, 8], 10)
    assert {k: after[k] for k in before} == before and (held2, held_raw2) == (held, held_raw)
    seen = {tuple(p) for k in before for p in before[k]} | {tuple(p) for p in held}
    part7 = {tuple(p) for p in after[7]}
    assert len(part7) == len(after[7]) and not part7 & seen
    old = [corpus.encode_request(tok, s.format(t=t)) for s in corpus.CHAT + corpus.EXTRA_CHAT
           + corpus.MORE_CHAT for t in TRAIN_TOPICS]
    old_styles_in_8 = {tuple(p) for p in after[8]} & {tuple(p) for p in old}
    assert len(old_styles_in_8) >= len(corpus.CHAT + corpus.EXTRA_CHAT + corpus.MORE_CHAT)


def _args(folder, tmp_path, parts):
    return argparse.Namespace(
        model=str(folder), parts=parts, seed=0, num_topics=2, templates_per_topic=1,
        raw_count=2, max_new=6, gen_dtype="float32", gen_batch=16,
        corpus_cache=str(tmp_path / "corpus.pt"))


def test_part8_answers_are_sampled_per_seed_and_part7_greedy(tiny, tmp_path, monkeypatch):
    folder, tok = tiny
    monkeypatch.setattr(corpus, "BROAD_COUNTS", {7: (1, 1, 2), 8: (1, 1, 2)})
    monkeypatch.setattr(corpus, "OLD_PER_STYLE", 1)
    monkeypatch.setattr(corpus, "OLD_RAW", 2)
    got = dict(features.corpus_parts(_args(folder, tmp_path, [7, 8]), tok)[0])
    prompts = {k: [s[:p] for s, p in got[f"part{k}"]] for k in (7, 8)}
    greedy = {k: corpus.generate_corpus(str(folder), prompts[k], 6, "float32", 16)
              for k in (7, 8)}
    assert got["part7"] == greedy[7]
    answers = [s[p:] for s, p in got["part8"]]
    differ = sum(a != s[p:] for a, (s, p) in zip(answers, greedy[8], strict=True))
    assert differ >= len(answers) // 2
    temp, top_p = corpus.SAMPLED_PARTS[8]
    again = corpus.generate_corpus(str(folder), prompts[8], 6, "float32", 16,
                                   (temp, top_p), seed=8000)
    assert again == got["part8"]               # the seed corpus_parts gives part 8
    other = corpus.generate_corpus(str(folder), prompts[8], 6, "float32", 16,
                                   (temp, top_p), seed=1)
    assert other != again
    assert torch.load(tmp_path / "corpus-part8.pt") == got["part8"]
