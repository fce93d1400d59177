"""Raw-text openings for the MTP corpus (tools/mtp_corpus.py part 4): what the completions
API is sent, no chat template. Code in several languages, prose, lists, dialogue and plain
questions, each an opening the model continues greedily.

Every opening is a template of one kind filled with one subject (or, for code, one task),
drawn from a seed. Training draws its subjects and tasks from SUBJECTS / TASKS, the
held-out set from HELD_OUT_SUBJECTS / HELD_OUT_TASKS only, so no held-out opening shares a
subject or task with a training one (checked at import, and by tests/tools/test_mtp_raw.py
against the generated prompt texts).
"""

from __future__ import annotations

import random

# (what it does, function name, arguments) per code task
TASKS = [
    ("reverse a string", "reverse_string", "s"), ("compute a factorial", "factorial", "n"),
    ("check whether a number is prime", "is_prime", "n"),
    ("return the n-th Fibonacci number", "fibonacci", "n"),
    ("count the words in a text", "count_words", "text"),
    ("find the largest element of a list", "find_max", "items"),
    ("merge two sorted lists", "merge_sorted", "a, b"),
    ("remove duplicates from a list", "unique", "items"),
    ("read a CSV file into rows", "read_csv", "path"),
    ("compute the average of numbers", "average", "values"),
    ("convert Celsius to Fahrenheit", "celsius_to_fahrenheit", "c"),
    ("check whether a word is a palindrome", "is_palindrome", "word"),
    ("sort a list with bubble sort", "bubble_sort", "items"),
    ("search a sorted array with binary search", "binary_search", "arr, target"),
    ("count vowels in a string", "count_vowels", "s"),
    ("compute the greatest common divisor", "gcd", "a, b"),
    ("flatten a nested list", "flatten", "nested"), ("transpose a matrix", "transpose", "m"),
    ("parse a date string", "parse_date", "text"),
    ("validate an email address", "is_valid_email", "address"),
    ("compute compound interest", "compound_interest", "principal, rate, years"),
    ("group words by their first letter", "group_by_letter", "words"),
    ("compute the distance between two points", "distance", "p, q"),
    ("capitalize every word in a sentence", "title_case", "sentence"),
    ("sum the digits of a number", "digit_sum", "n"), ("rotate a list by k", "rotate", "xs, k"),
    ("count the lines of a file", "count_lines", "path"),
    ("convert a number to binary", "to_binary", "n"),
    ("find the intersection of two lists", "intersection", "a, b"),
    ("compute the median of a list", "median", "values"),
    ("check whether brackets are balanced", "is_balanced", "expr"),
    ("generate prime numbers up to n", "primes_up_to", "n"),
    ("compute a running total", "running_total", "values"),
    ("split a list into chunks", "chunks", "items, size"),
    ("encode a string with a Caesar cipher", "caesar", "text, shift"),
    ("find the most common element", "most_common", "items"),
]
HELD_OUT_TASKS = [
    ("compute the power set of a set", "power_set", "items"),
    ("convert Roman numerals to integers", "roman_to_int", "s"),
    ("check whether two words are anagrams", "are_anagrams", "a, b"),
    ("compute the least common multiple", "lcm", "a, b"),
    ("count the frequency of characters", "char_frequency", "text"),
    ("find the second largest number", "second_largest", "nums"),
]
SUBJECTS = [
    "the ocean", "volcanoes", "a bakery", "the railway", "honey", "the violin maker",
    "a mountain village", "the printing of maps", "electric motors", "wolves", "the desert",
    "a lighthouse", "the human brain", "coffee farming", "a river town", "glass blowing",
    "the tides", "a space probe", "bees", "the Roman roads", "chess", "a storm",
    "cloud computing", "a garden", "the telegraph", "the night train", "windmills",
    "the history of paper", "an old bridge", "a fishing village", "the first clocks",
    "a snow leopard", "a market square", "solar power", "the moon", "a detective",
    "a robot", "the city council", "a school trip", "the weather", "rice", "a castle",
    "the Andes", "a jazz band", "a small shop", "the post office", "bread", "a volcano island",
    "the immune system", "a lost letter", "the football club", "a new phone", "owls",
    "the Nile", "a pirate", "the kitchen", "a spaceship", "tea", "the forest", "a museum",
    "the stock market", "a hospital", "the harbour", "a painter", "mushrooms", "a city bus",
    "the village fair", "a dragon", "an inventor", "the library", "a farmer", "the Vikings",
    "a mountain road", "the internet", "a teacher", "a thunderstorm", "the planets",
    "a bicycle", "an island", "the king", "a soldier", "the theatre", "a wedding", "whales",
]
HELD_OUT_SUBJECTS = [
    "a paper lantern", "the canal boats", "a glacier lake", "the salt mines", "a clockwork toy",
    "the night sky over Iceland", "a beekeeper", "the old observatory", "a tram line",
    "the copper mine", "a sailing race", "a puppet theatre",
]
NAMES = ["Anna", "Ben", "Carlos", "Dana", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack",
         "Kofi", "Lena", "Maya", "Noah", "Olga", "Priya", "Sam", "Tom", "Yara", "Zoe"]

CODE = {
    "python": 'def {fn}({args}):\n    """{Task}."""\n',
    "python-class": "# {Task}\n\n\nclass Solution:\n    def {fn}(self, {args}):\n",
    "javascript": "// {Task}\nfunction {camel}({args}) {{\n",
    "typescript": "/**\n * {Task}.\n */\nexport function {camel}({args}: any) {{\n",
    "c": "#include <stdio.h>\n\n/* {Task} */\nint {fn}(",
    "cpp": "#include <vector>\n#include <string>\n\n// {Task}\nauto {fn}(",
    "java": "public class Main {{\n    // {Task}\n    public static int {camel}(",
    "rust": "/// {Task}.\nfn {fn}(",
    "go": "package main\n\n// {camel} will {task}.\nfunc {camel}(",
    "shell": "#!/bin/bash\n# {Task}\n",
    "sql": "-- {Task} (example schema)\nCREATE TABLE",
    "test": "import pytest\n\n\ndef test_{fn}():\n",
}
PROSE = [
    "{S} is", "The history of {s} begins", "Once upon a time, {name} found {s}",
    "It was a cold morning when {name} first saw {s}.", "Chapter 1\n\n{S} had",
    "{S}\n\nFrom Wikipedia, the free encyclopedia\n\n{S} is",
    "In the summer of 1998, {s}", "Breaking news: {s}", "Dear {name},\n\nI am writing about {s}",
    "My favourite thing about {s} is", "Abstract. We study {s}", "Why {s} matters\n\n",
    "{name} had always wondered about {s}.", "Review: {s}\n\nRating: 4/5\n\n",
]
LISTS = [
    "Ten facts about {s}:\n\n1.", "Things to pack for a trip to {s}:\n-",
    "Pros and cons of {s}\n\nPros:\n1.", "Checklist: {s}\n- [ ]",
    "Steps to learn about {s}:\nStep 1:",
    "Top 5 books about {s}:\n\n1.", "Shopping list for {s}:\n*", "FAQ about {s}\n\nQ1:",
]
DIALOGUE = [
    "{name}: Have you heard about {s}?\n{name2}:",
    "INTERVIEWER: Tell us about {s}.\n{NAME}:", "Customer: I have a question about {s}.\nAgent:",
    "Teacher: Today we talk about {s}.\nStudent:", "{NAME}\nWhere is {s}?\n\n{NAME2}\n",
    "\"What do you know about {s}?\" asked {name}.\n\n\"",
]
QUESTIONS = [
    "What is {s}?", "How does {s} work?", "Q: Why is {s} important?\nA:",
    "Question: What should I know about {s}?\nAnswer:", "Can you tell me about {s}",
    "Who first wrote about {s}?", "how to learn about {s}",
]
KINDS = {"prose": PROSE, "list": LISTS, "dialogue": DIALOGUE, "question": QUESTIONS}


def check_disjoint() -> None:
    """Held-out subjects/tasks must not occur in, or contain, any training one."""
    for name, train, held in (("subjects", SUBJECTS, HELD_OUT_SUBJECTS),
                              ("tasks", [t[0] for t in TASKS] + [t[1] for t in TASKS],
                               [t[0] for t in HELD_OUT_TASKS] + [t[1] for t in HELD_OUT_TASKS])):
        both = [(h, t) for h in held for t in train
                if h.lower() in t.lower() or t.lower() in h.lower()]
        if both:
            raise ValueError(f"held-out raw {name} overlap the training ones: {both}")


def _camel(fn: str) -> str:
    head, *rest = fn.split("_")
    return head + "".join(w.capitalize() for w in rest)


def _fill(tmpl: str, s: str, rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    return tmpl.format(s=s, S=s[0].upper() + s[1:], name=a, name2=b, NAME=a.upper(),
                       NAME2=b.upper())


def _code(lang: str, task: tuple[str, str, str]) -> str:
    what, fn, args = task
    return CODE[lang].format(task=what, Task=what[0].upper() + what[1:], fn=fn, args=args,
                             camel=_camel(fn))


def raw_texts(seed: int, n: int, held_out: bool = False, code_share: float = 0.3
              ) -> list[str]:
    """`n` distinct openings from `seed`: about `code_share` code (language x task), the
    rest split over prose, lists, dialogue and questions (template x subject)."""
    rng = random.Random(seed)
    subjects = HELD_OUT_SUBJECTS if held_out else SUBJECTS
    tasks = HELD_OUT_TASKS if held_out else TASKS
    langs, kinds = sorted(CODE), sorted(KINDS)
    out, seen = [], set()
    for _ in range(n * 50):
        if len(out) == n:
            break
        if rng.random() < code_share:
            text = _code(rng.choice(langs), rng.choice(tasks))
        else:
            text = _fill(rng.choice(KINDS[rng.choice(kinds)]), rng.choice(subjects), rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct raw openings for n={n}")
    return out


def raw_prompts(tokenizer, seed: int, n: int, held_out: bool = False) -> list[list[int]]:
    """The openings as the engine encodes a string prompt (no chat template)."""
    return [tokenizer.encode(t) for t in raw_texts(seed, n, held_out)]


def held_out_raw_texts(n: int = 64) -> list[str]:
    """The held-out raw openings (bench/spec_decode.py and the training's evaluation)."""
    return raw_texts(HELD_OUT_SEED, n, held_out=True)


HELD_OUT_SEED = 1015
check_disjoint()
