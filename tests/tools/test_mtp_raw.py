"""The MTP corpus's raw-text part (tools/mtp_raw.py): reproducible from its seed, of every
kind (code in several languages, prose, lists, dialogue, questions), and its held-out set
disjoint from the training openings by construction: no held-out subject or code task
appears in any training opening, and no opening is in both."""

from __future__ import annotations

import pytest

import tools.mtp_raw as raw
from tools.mtp_corpus import RAW_COUNT, RAW_HELD_OUT

TRAIN_SEED = 0 + 4          # tools/mtp_corpus.py corpus_prompts: part 4 from seed + 4


@pytest.fixture(scope="module")
def train():
    return raw.raw_texts(TRAIN_SEED, RAW_COUNT)


@pytest.fixture(scope="module")
def held():
    return raw.held_out_raw_texts(RAW_HELD_OUT)


def test_reproducible_and_distinct(train, held):
    assert raw.raw_texts(TRAIN_SEED, RAW_COUNT) == train
    assert raw.held_out_raw_texts(RAW_HELD_OUT) == held
    assert len(set(train)) == len(train) == RAW_COUNT
    assert len(set(held)) == len(held) == RAW_HELD_OUT
    assert raw.raw_texts(TRAIN_SEED + 1, 50) != train[:50]


def test_held_out_is_disjoint_from_training(train, held):
    assert not set(train) & set(held)
    lowered = [t.lower() for t in train]
    for subject in raw.HELD_OUT_SUBJECTS:
        assert not any(subject.lower() in t for t in lowered), subject
    for what, fn, _ in raw.HELD_OUT_TASKS:
        assert not any(what.lower() in t or fn in t for t in lowered), fn
    # and every held-out opening is built from a held-out subject or task
    for text in held:
        assert any(s in text or s[0].upper() + s[1:] in text for s in raw.HELD_OUT_SUBJECTS) \
            or any(fn in text or raw._camel(fn) in text or what[0].upper() + what[1:] in text
                   for what, fn, _ in raw.HELD_OUT_TASKS), \
            text


def test_every_kind_and_several_languages(train, held):
    def kinds(texts):
        out = {}
        for lang, tmpl in raw.CODE.items():
            head = tmpl.split("{")[0]
            out[lang] = sum(t.startswith(head) and bool(head) for t in texts)
        for kind, templates in raw.KINDS.items():
            heads = [t.split("{")[0] for t in templates]
            out[kind] = sum(any(t.startswith(h) for h in heads if h) for t in texts)
        return out
    got = kinds(train)
    for lang in ("python", "javascript", "c", "rust", "go", "java", "sql"):
        assert got[lang] >= 20, (lang, got)
    for kind in raw.KINDS:
        assert got[kind] >= 100, (kind, got)
    assert sum(v > 0 for k, v in kinds(held).items() if k in raw.CODE) >= 4


def test_overlapping_held_out_lists_are_refused(monkeypatch):
    monkeypatch.setattr(raw, "HELD_OUT_SUBJECTS", raw.HELD_OUT_SUBJECTS + [raw.SUBJECTS[3]])
    with pytest.raises(ValueError, match="overlap"):
        raw.check_disjoint()
