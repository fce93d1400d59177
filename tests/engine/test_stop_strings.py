"""Stop strings inside the engine: the text a request's outputs carry, added up, equals
the greedy text cut before the stop string, wherever the stop falls (also across token
boundaries, where the text already emitted could otherwise run past the cut)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import add_tiny_tokenizer

PROMPT = "Hello world, this is a test"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder, _ = make_tiny_model("qwen2-gqa4", tmp_path_factory.mktemp("models"))
    return LLM(add_tiny_tokenizer(folder), dtype="float32", block_size=4, num_gpu_blocks=128)


def test_every_two_char_stop_cuts_the_text_exactly(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0))[0]
    text = full.outputs[0].text
    assert len(text) > 4
    for start in range(len(text) - 2):
        stop = text[start:start + 2]
        out = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0,
                                                  stop=[stop]))[0].outputs[0]
        assert out.text == text[:text.find(stop)], stop
        assert out.finish_reason == "stop" and out.stop_reason == stop
