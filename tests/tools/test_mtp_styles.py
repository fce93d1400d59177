"""The style-split held-out set of the MTP head (tools/mtp_styles.py, issue 39) stays out of
everything the corpus trains on: at least 12 styles of at least 6 requests, none of which
is a corpus request template filled with any topic, mentions a training topic, or equals a
raw-text training opening; raw sources of at least 4 openings each, none in the corpus's
raw part; and nothing repeated."""

from __future__ import annotations

import re

import tools.mtp_broad as broad
import tools.mtp_corpus as corpus
import tools.mtp_raw as raw
from tools.mtp_corpus import RAW_COUNT
from tools.mtp_styles import chat_requests, raw_texts


def _template_patterns() -> list[re.Pattern]:
    templates = (corpus.CHAT + corpus.EXTRA_CHAT + corpus.MORE_CHAT + broad.TOPIC_STYLES
                 + broad.WORD_STYLES)
    holes = [re.escape(f"{{{h}}}") for h in ("t", "w", "ws")]
    out = []
    for t in templates:
        pattern = re.escape(t)
        for hole in holes:
            pattern = pattern.replace(hole, ".+")
        out.append(re.compile("^" + pattern + "$", re.I))
    return out


def test_the_patterns_catch_a_filled_template():
    """The check below can fail: a corpus request of every kind matches its pattern."""
    patterns = _template_patterns()
    for request in (corpus.CHAT[0].format(t="owls"), broad.TOPIC_STYLES[5].format(t="owls"),
                    broad.WORD_STYLES[-1].format(w="x", ws="a, b, c, d")):
        assert any(p.match(request) for p in patterns), request


def test_styles_and_sources_are_many_and_distinct():
    styles, sources = chat_requests(), raw_texts()
    assert len(styles) >= 12 and all(len(r) >= 6 for r in styles.values())
    assert len(sources) >= 4 and all(len(t) >= 4 for t in sources.values())
    every = [r for reqs in styles.values() for r in reqs] + \
        [t for texts in sources.values() for t in texts]
    assert len(set(every)) == len(every)


def test_no_request_is_a_corpus_template_or_topic():
    patterns = _template_patterns()
    topics = [t.lower() for t in corpus.TOPICS + corpus.EXTRA_TOPICS + corpus.NEW_TOPICS]
    for style, reqs in chat_requests().items():
        for r in reqs:
            assert not any(p.match(r) for p in patterns), (style, r)
            words = f" {r.lower()} "
            hits = [t for t in topics if len(t) > 4 and f" {t} " in words]
            assert not hits, (style, r, hits)


def test_no_raw_opening_is_in_the_corpus():
    train = set(raw.raw_texts(4, RAW_COUNT)) | set(raw.held_out_raw_texts())
    for seed, counts in ((7, corpus.BROAD_COUNTS[7]), (8, corpus.BROAD_COUNTS[8])):
        train |= set(broad.broad_texts(seed, corpus.TOPICS, *counts)[1])
    starts = {t.split("{")[0] for kind in broad.RAW_KINDS.values() for t in kind}
    for source, texts in raw_texts().items():
        for t in texts:
            assert t not in train, (source, t)
            assert not any(t[:40] in x for x in train), (source, t)
            assert not any(s and t.startswith(s) for s in starts), (source, t)
