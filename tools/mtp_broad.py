"""Parts 7 and 8 of the MTP corpus (issue 39): many request styles at small counts, instead
of few styles at large counts, and sampled answers beside the greedy ones.

Parts 1-6 ask 30 styles, and part 6 asked 275 topics in the bench's own four: the head
learned those styles, and on styles it never saw (tools/mtp_styles.py) it accepts less.
Here:

- part 7 (greedy answers): every request style below (56 on a topic, 12 on words or short
  lists the request carries itself) at a few dozen requests each, on topics drawn from
  all training topics, and raw text of 14 kinds the raw part (tools/mtp_raw.py) does not
  have, on its training subjects;
- part 8 (answers sampled at temperature 0.8, top-p 0.95, one seed per request): another
  draw of the same styles and raw kinds, plus the corpus's earlier 30 styles and raw
  openings, so the head also sees the target's states off its greedy path.

None of these styles or raw kinds is one of the held-out set's (rewrite, continue a
dialogue, explain code, numbered plan, complaint letter, text table, short fact, story
opening, product description, compare two, arithmetic, translate; recipes, terms,
release notes, logs, sports reports): tests/tools/test_mtp_styles.py checks that no
held-out request matches any template here and no held-out raw opening shares its start
with one.
"""

from __future__ import annotations

import random

# Request styles on one topic ({t}).
TOPIC_STYLES = [
    "Write a haiku about {t}.", "Write a limerick about {t}.",
    "Give me a catchy slogan for {t}.", "Write five quiz questions about {t} with answers.",
    "Brainstorm ten names for a club devoted to {t}.", "Write a tweet about {t}.",
    "Write a job advertisement for someone who works with {t}.",
    "Review a documentary about {t}.", "Describe {t} using only simple words.",
    "What questions would a scientist ask about {t}?", "Write a riddle whose answer is {t}.",
    "Summarize {t} in one sentence.", "Ask a yes-or-no question about {t} and answer it.",
    "Write a song chorus about {t}.", "Write a motivational quote inspired by {t}.",
    "Define {t} the way a dictionary would.", "Suggest a hobby related to {t} and say why.",
    "Write an interview with an expert on {t}.",
    "Describe {t} from the point of view of a child.", "Explain {t} with an analogy.",
    "What mistakes do people often make with {t}?",
    "Write a JSON object that describes {t} with a few fields.",
    "Write Python code that prints three facts about {t}.",
    "Write a markdown document with headings about {t}.",
    "Write a poem about {t} in rhyming couplets.",
    "Describe the sounds, smells and colors of {t}.",
    "Write a thank-you note that mentions {t}.", "Pretend you are {t} and introduce yourself.",
    "Give me one fun fact about {t}.", "Argue that {t} is overrated.",
    "What might {t} look like in a hundred years?", "Write a short scene for a play about {t}.",
    "Write a crossword clue for {t}.",
    "List the words a student should learn about {t}, with definitions.",
    "Write an encyclopedia entry about {t}.",
    "Write a text message inviting a friend to learn about {t}.",
    "Explain {t} like a pirate would.",
    "What would an expert and a beginner disagree about regarding {t}?",
    "Give me a mnemonic to remember facts about {t}.", "Write a bedtime story about {t}.",
    "Summarize {t} in exactly three bullet points.",
    "Ask me five questions to test what I know about {t}.",
    "What are the biggest open questions about {t}?",
    "Write a social media post announcing an event about {t}.",
    "Give me a short history lesson on {t} in the form of a timeline.",
    "Explain {t} to someone from the year 1800.",
    "Write the introduction of a school report on {t}.",
    "What careers are connected to {t}?",
    "Write a motivational speech for a team that studies {t}.",
    "Describe a museum exhibit about {t}.", "Give me tips for photographing {t}.",
    "Write a two-sentence horror story about {t}.", "What do most people not know about {t}?",
    "Write a weather forecast as if {t} were the weather.",
    "Write an acrostic poem about {t}.",
    "Write a conversation between a robot and a child about {t}.",
]

# Request styles that carry their own material: single words, short lists of words.
WORDS = [
    "river", "bright", "garden", "whisper", "journey", "silver", "courage", "lantern",
    "harvest", "gentle", "thunder", "puzzle", "orchard", "brave", "mirror", "candle",
    "meadow", "quick", "shadow", "island", "anchor", "velvet", "forest", "clever", "ribbon",
    "pepper", "marble", "rocket", "planet", "window", "blanket", "crystal", "feather",
    "canyon", "tunnel", "engine", "season", "cotton", "silence", "compass",
]
WORD_STYLES = [
    "Give three synonyms for the word '{w}'.", "What rhymes with '{w}'?",
    "Use the word '{w}' in three different sentences.",
    "Is '{w}' a noun, a verb or an adjective? Explain.",
    "Write a short poem where every line ends with '{w}'.",
    "What is the opposite of '{w}'?", "Spell '{w}' backwards and count its letters.",
    "Sort these words alphabetically: {ws}.", "Which word is the odd one out: {ws}?",
    "Write a sentence that uses all of these words: {ws}.",
    "Group these words by their first letter: {ws}.",
    "Make up a short story that uses the words {ws}.",
]

# Raw text (no chat template) of kinds the raw part does not draw on.
RAW_KINDS: dict[str, list[str]] = {
    "email_thread": ["From: {name}\nTo: {name2}\nSubject: Re: {s}\n\nHi {name2},\n\n",
                     "-----Original Message-----\nFrom: {name}\nSent: Monday\n"
                     "Subject: {s}\n\n"],
    "forum_post": ["Posted by {name} in General Discussion\n\nHas anyone here tried {s}? I",
                   "Thread: Question about {s}\n\n{name} wrote:\n> "],
    "readme": ["# {S}\n\nA small project about {s}.\n\n## Installation\n\n",
               "## Getting started with {s}\n\nThis guide explains"],
    "config": ["# settings for {s}\nname: {slug}\nversion: 1\noptions:\n  ",
               '{{\n  "name": "{slug}",\n  "description": "{S}",\n  "'],
    "html": ["<!DOCTYPE html>\n<html>\n<head>\n  <title>{S}</title>\n</head>\n<body>\n  <h1>",
             '<div class="card">\n  <h2>{S}</h2>\n  <p>'],
    "csv": ["name,category,year,notes\n{slug},{s},", "id,title,author,rating\n1,{S},"],
    "glossary": ["Glossary of {s}\n\nA\n", "Key terms: {s}\n\n- "],
    "quiz": ["Quiz: {S}\n\n1. Which of the following is true?\n   a)",
             "Test yourself on {s}\n\nQuestion 1:"],
    "poem": ["{S}\n\nBeneath the", "Ode to {s}\n\nO"],
    "screenplay": ["INT. {SCENE} - NIGHT\n\n{NAME} enters, holding", "EXT. {SCENE} - DAY\n\n"],
    "minutes": ["Meeting minutes: {s} committee\nAttendees: {name}, {name2}\n\n1.",
                "Notes from the {s} planning call\n\nAction items:\n-"],
    "timeline": ["Timeline of {s}\n\n1850 -", "Key dates in the story of {s}:\n\n"],
    "speech": ["Ladies and gentlemen, thank you for coming tonight to talk about {s}.",
               "Good morning everyone. Today I want to tell you about {s}"],
    "textbook": ["Chapter 3: {S}\n\nLearning objectives\n\nBy the end of this chapter",
                 "Section 2.1 {S}\n\nIn the previous section we saw"],
}


def _slug(s: str) -> str:
    return "-".join(w for w in s.lower().replace("'", "").split() if w not in ("a", "an", "the"))


def raw_kind_text(tmpl: str, subject: str, rng: random.Random) -> str:
    from tools.mtp_raw import NAMES
    a, b = rng.sample(NAMES, 2)
    return tmpl.format(s=subject, S=subject[0].upper() + subject[1:], slug=_slug(subject),
                       SCENE=subject.upper(), name=a, name2=b, NAME=a.upper())


def word_request(tmpl: str, rng: random.Random) -> str:
    ws = rng.sample(WORDS, 4)
    return tmpl.format(w=ws[0], ws=", ".join(ws))


def broad_texts(seed: int, topics: list[str], per_style: int, per_word_style: int,
                per_raw_kind: int) -> tuple[list[str], list[str]]:
    """(chat requests, raw openings) from `seed`: every topic style `per_style` times on
    distinct topics, every word style `per_word_style` times, every raw kind
    `per_raw_kind` times on the raw part's training subjects; no text twice."""
    from tools.mtp_raw import SUBJECTS
    rng = random.Random(seed)
    chat = [s.format(t=t) for s in TOPIC_STYLES for t in rng.sample(topics, per_style)]
    chat += _distinct([lambda tmpl=tmpl: word_request(tmpl, rng) for tmpl in WORD_STYLES],
                      per_word_style)
    raw = _distinct([lambda tmpl=tmpl: raw_kind_text(tmpl, rng.choice(SUBJECTS), rng)
                     for tmpls in RAW_KINDS.values() for tmpl in tmpls],
                    max(1, per_raw_kind // 2))
    return chat, raw


def _distinct(makers, n_each: int) -> list[str]:
    out, seen = [], set()
    for make in makers:
        got = 0
        for _ in range(n_each * 50):
            if got == n_each:
                break
            text = make()
            if text not in seen:
                seen.add(text)
                out.append(text)
                got += 1
    return out
