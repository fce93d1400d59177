"""Fixtures the corpus tools' tests share."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import add_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, Tokenizer) of a random-weight tiny Llama with the tiny tokenizer."""
    folder, _ = make_tiny_model("llama-tied-gqa", tmp_path_factory.mktemp("tiny-tok"))
    add_tiny_tokenizer(folder)
    from engine.tokenizer import Tokenizer
    return folder, Tokenizer(str(folder))
