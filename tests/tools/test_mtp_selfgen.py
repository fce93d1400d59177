"""Part 9 of the MTP corpus (tools/mtp_selfgen.py): requests and raw openings the target
samples itself. What is tested: the held-out filters catch every held-out request and raw
opening (so they can fail), no kept text looks like a held-out style, the sampled prompts
are kept beside the corpus cache and reused, and the user's turn starts where the chat
template puts it."""

from __future__ import annotations

import argparse
import json

from hypothesis import given, settings
from hypothesis import strategies as st

import tools.mtp_corpus as corpus
import tools.mtp_features as features
import tools.mtp_selfgen as selfgen
from tools.mtp_corpus import encode_request
from tools.mtp_styles import chat_requests, raw_texts


def test_every_held_out_request_and_opening_is_caught_by_its_own_marker():
    assert set(selfgen.STYLE_MARKERS) == set(chat_requests())
    assert set(selfgen.RAW_MARKERS) == set(raw_texts())
    for style, requests in chat_requests().items():
        for r in requests:
            assert selfgen._STYLE_RE[style].search(r), (style, r)
    for source, texts in raw_texts().items():
        for t in texts:
            assert selfgen._RAW_RE[source].search(t), (source, t)


def test_requests_unlike_the_held_out_styles_pass():
    for r in ("Can you suggest some books for my trip to the mountains?",
              "I'm thinking about adopting a rescue dog. What should I know first?",
              "Help me name my new bakery."):
        assert selfgen.held_out_style(r) is None, r
    assert selfgen.held_out_source("The old mill stood at the edge of the village, and") \
        is None


_TEXTS = st.lists(st.one_of(
    st.sampled_from([r for rs in chat_requests().values() for r in rs]),
    st.text(alphabet=st.characters(codec="ascii", exclude_categories=["Cc"]), max_size=40)),
    max_size=30)


@settings(max_examples=200, deadline=None)
@given(texts=_TEXTS, want=st.integers(0, 40))
def test_kept_texts_are_new_long_enough_unlike_the_held_out_and_at_most_wanted(texts, want):
    seen: set[str] = set()
    dropped: dict[str, int] = {}
    kept = selfgen._keep(texts, selfgen.held_out_style, want, seen, dropped)
    assert len(kept) <= want and len(set(kept)) == len(kept) and set(kept) <= seen
    assert all(len(t) >= 12 and selfgen.held_out_style(t) is None for t in kept)
    rest = iter(texts)
    assert all(t in rest for t in kept)                  # a subsequence: in sampled order
    consumed = len(kept) + sum(dropped.values())
    assert consumed <= len(texts)
    if len(kept) < want:
        assert consumed == len(texts)        # stops early only when it has enough


def test_the_pre_query_is_the_chat_template_before_the_users_message(tiny):
    _, tok = tiny
    request = "Help me name my new bakery."
    whole = tok.apply_chat_template([{"role": "user", "content": request}], True)
    pre = selfgen.pre_query(tok)
    assert pre and whole.startswith(pre + request)


def test_self_generated_parts_are_sampled_once_each_kept_beside_the_cache_and_encoded(
        tiny, tmp_path, monkeypatch):
    folder, tok = tiny
    calls = []

    def sampled(model, tokenizer, seed):            # the target's sampling: a boundary
        calls.append(seed)
        return ([f"Help me name my new bakery ({seed}).", "Suggest a weekend hobby."],
                ["The old mill"])
    monkeypatch.setattr(selfgen, "self_generated", sampled)
    args = argparse.Namespace(model=str(folder), seed=0, corpus_cache=str(tmp_path / "c.pt"))
    first = features.self_generated_prompts(args, tok, 9)
    assert calls == [9000]
    kept = json.loads((tmp_path / "c-part9-prompts.json").read_text())
    assert kept == {"requests": ["Help me name my new bakery (9000).",
                                 "Suggest a weekend hobby."], "raw": ["The old mill"]}
    assert first == [encode_request(tok, "Help me name my new bakery (9000)."),
                     encode_request(tok, "Suggest a weekend hobby."), tok.encode("The old mill")]
    assert features.self_generated_prompts(args, tok, 9) == first
    assert calls == [9000]                           # the second run read the file
    tenth = features.self_generated_prompts(args, tok, 10)     # its own draw and file
    assert calls == [9000, 10000] and tenth != first
    assert (tmp_path / "c-part10-prompts.json").is_file()
    assert features.self_generated_prompts(args, tok, 9) == first


def test_part_10_is_the_self_generated_part_with_sampled_answers():
    assert set(corpus.SELF_PARTS) == {9, 10}
    assert 10 in corpus.SAMPLED_PARTS and 9 not in corpus.SAMPLED_PARTS
