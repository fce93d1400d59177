"""Part 9 of the MTP corpus (issue 39): requests and raw text the target writes itself.

Parts 1-8 ask hand-written request templates; on styles none of them uses the head
accepts less, and every new template family added a little (parts 7-8: +0.02 on the
held-out median). Here nobody writes the styles: the target samples them.

- requests: the chat template up to where the user's message starts (system turn, then
  `<|im_start|>user`), sampled on at temperature 1.0, top-p 0.95, one seed each, until
  the model ends the user's turn. An instruction-tuned model then writes the kind of
  request it was tuned on, a broad and realistic spread of styles, topics and lengths,
  written by no template (the Magpie recipe, Xu et al. 2024);
- raw text: sampled the same way from the document separator alone (token 0), the
  model's own idea of a document's opening.

The answers (and continuations) are then generated greedily like any other part. So that
the held-out set of tools/mtp_styles.py stays unseen, every sampled request that looks
like one of its twelve styles (`held_out_style`: rewrite, continue a dialogue, explain
code, a plan, a letter, a table, a short factual question, a story, a product, a
comparison, arithmetic, a translation) and every raw opening that looks like one of its
five raw sources is dropped, and the counts of what was dropped are printed.
"""

from __future__ import annotations

import random
import re
import time

# One pattern per held-out style / raw source (tools/mtp_styles.py); every held-out
# request and opening matches its own (tests/tools/test_mtp_selfgen.py).
STYLE_MARKERS: dict[str, str] = {
    "rewrite": r"\b(rewrite|rephrase|paraphrase|reword|passive voice|proofread|edit|make "
               r"(this|it) (shorter|friendlier|simpler|clearer)|plain english|"
               r"for a \w+-year-old|turn this|into an? (polite |formal )?(email|note|message))",
    "continue_dialogue": r"\b(continue|dialogue|conversation|next (few )?(turns|lines)|"
                         r"keep (this|the) scene|exchange)\b",
    "explain_code": r"\b(code|function|script|query|command|snippet|sql|python|javascript|"
                    r"program)\b",
    "numbered_plan": r"\b(plan|checklist|step[- ]by[- ]step|steps|schedule|itinerary|"
                     r"numbered|in order)\b",
    "complaint_letter": r"\b(letter|complain\w*|complaint|dispute|disputing|refund|"
                        r"landlord|draft)\b",
    "text_table": r"\btables?\b",
    "short_fact": r"^\s*(what|who|how many|when|where|in which|which)\b[^.?!\n]{0,60}\?\s*$",
    "story_opening": r"\b(stor(y|ies)|opening|first (paragraph|scene|lines?)|begin|"
                     r"start a)\b",
    "product_description": r"\b(product|listing|blurb|online (store|shop)|shopping|"
                           r"for sale)\b",
    "compare_two": r"\b(compare|comparison|comparing|differences?|different from|versus|"
                   r"vs\.?|better for|pros and cons)\b",
    "arithmetic": r"(\d\s*[-+*/x%]\s*\d|\b(solve|calculate|times|plus|minus|divided|"
                  r"percent|average speed|show (your|the) (steps|math|work)|how much|"
                  r"work it out|how many \w+ until|\$\d)\b)",
    "translate": r"\b(translat\w*|in (french|spanish|german|italian|portuguese|english)|"
                 r"how do you say)\b",
}
RAW_MARKERS: dict[str, str] = {
    "recipe": r"\b(ingredients?|recipe|preheat|tbsp|tsp|cups? of|bake|whisk|serves \d)",
    "terms": r"\b(terms of service|privacy policy|agreement|liabilit\w*|terminat\w*|"
             r"hereby|shall)\b",
    "release_notes": r"(\bversion \d|\brelease notes?\b|changelog|bug ?fix|what's new|"
                     r"## \[?\d)",
    "log_lines": r"(\b(INFO|WARN|WARNING|ERROR|DEBUG)\b|traceback|\bGET /|\d\d:\d\d:\d\d)",
    "sports_report": r"\b(score[ds]?|match|championship|tournament|season|minute|"
                     r"team|coach|goal|race|runners?|final set|champion\w*)\b",
}
_STYLE_RE = {k: re.compile(v, re.I) for k, v in STYLE_MARKERS.items()}
_RAW_RE = {k: re.compile(v, re.I) for k, v in RAW_MARKERS.items()}

REQUESTS, RAW_OPENINGS = 4000, 1000      # kept after the filters
RAW_OPENING_TOKENS = 32


def held_out_style(text: str) -> str | None:
    """The held-out request style `text` looks like, or None."""
    return next((k for k, r in _STYLE_RE.items() if r.search(text)), None)


def held_out_source(text: str) -> str | None:
    """The held-out raw source `text` looks like, or None."""
    return next((k for k, r in _RAW_RE.items() if r.search(text)), None)


def pre_query(tokenizer) -> str:
    """The chat template's text before the user's message."""
    marker = "\x00REQUEST\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], True)
    return text[:text.index(marker)]


def _sample(llm, tokenizer, prompt_ids: list[int], n: int, seed: int, max_tokens: int,
            stop: bool) -> list[str]:
    from engine import SamplingParams
    eos = [tokenizer.eos_token_id]
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95,
                             seed=seed + i, stop_token_ids=eos if stop else [])
              for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt_ids}] * n, params, use_tqdm=True)
    texts = []
    for o in outs:
        c = o.outputs[0]
        if stop and c.finish_reason != "stop":
            texts.append("")        # cut off mid-request: not a request
            continue
        ids = [t for t in c.token_ids if t not in eos]
        texts.append(tokenizer.decode(ids).strip())
    return texts


def _keep(texts: list[str], marker, want: int, seen: set[str], dropped: dict) -> list[str]:
    out = []
    for t in texts:
        if len(out) == want:
            break
        if len(t) < 12 or t in seen:
            dropped["short or repeated"] = dropped.get("short or repeated", 0) + 1
            continue
        hit = marker(t)
        if hit is not None:
            dropped[hit] = dropped.get(hit, 0) + 1
            continue
        seen.add(t)
        out.append(t)
    return out


def self_generated(model_dir: str, tokenizer, seed: int, requests: int = REQUESTS,
                   raw: int = RAW_OPENINGS, batch: int = 256
                   ) -> tuple[list[str], list[str]]:
    """(requests, raw openings) sampled from the target, filtered as the module says;
    sampled in rounds from `seed` until there are enough."""
    from engine import LLM
    t0 = time.time()
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=batch, max_num_batched_tokens=8192)
    query = tokenizer.encode(pre_query(tokenizer), add_special_tokens=False)
    rng = random.Random(seed)
    got: dict[str, list[str]] = {"requests": [], "raw": []}
    dropped: dict[str, dict] = {"requests": {}, "raw": {}}
    seen: set[str] = set()
    for kind, want, prompt, marker, stop, length in (
            ("requests", requests, query, held_out_style, True, 128),
            ("raw", raw, [0], held_out_source, False, RAW_OPENING_TOKENS)):
        for _ in range(8):
            need = want - len(got[kind])
            if need <= 0:
                break
            texts = _sample(llm, tokenizer, prompt, max(64, 2 * need),
                            rng.randrange(1 << 30), length, stop)
            got[kind] += _keep(texts, marker, need, seen, dropped[kind])
        if len(got[kind]) < want:
            raise RuntimeError(f"only {len(got[kind])} of {want} self-generated {kind} "
                               f"survived the held-out filters ({dropped[kind]})")
        print(f"self-generated {kind}: kept {want}, dropped {dropped[kind]}", flush=True)
    print(f"self-generated prompts in {time.time() - t0:.0f}s", flush=True)
    return got["requests"], got["raw"]
