"""A tiny byte-level BPE tokenizer (320 ids, matching tests/tiny_models.py's vocab) with a
chat template, written into a tiny model folder so the router can tokenize for it.

Trained deterministically on a fixed text; ids 0/1/2 are <pad>/<s>/</s> like the tiny
models' pad/bos/eos. Random models emit any id, so decoding exercises special tokens and
partial UTF-8 sequences too.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

_TEXT = ("The quick brown fox jumps over the lazy dog. Prefill and decode run on different "
         "nodes; the router streams tokens back. Hello, world! 你好，世界。 Ünïcödé ✓ ") * 20


def add_tiny_tokenizer(folder: Path, vocab_size: int = 320) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if (folder / "tokenizer.json").is_file():
        return folder
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT], trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE}))
    return folder
