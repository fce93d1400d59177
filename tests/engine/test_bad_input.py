"""Bad input gets a ValueError naming the field and the allowed range, and the engine
keeps serving afterwards; bad model folders name what is missing."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), r"temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), r"top_k must be -1 \(disabled\) or an integer >= 1"),
    (dict(top_k=-2), r"top_k must be -1"),
    (dict(max_tokens=0), r"max_tokens must be an integer >= 1"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0"),
    (dict(presence_penalty=3.0), r"presence_penalty must be in \[-2, 2\]"),
    (dict(logprobs=50), r"logprobs must be None or an integer in \[0, 20\]"),
    (dict(stop=[""]), r"stop must be a non-empty string"),
    (dict(temprature=0.5), r"unknown SamplingParams field\(s\) \['temprature'\]"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder, _ = make_tiny_model("llama-tied-gqa", tmp_path_factory.mktemp("m"))
    return LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=64, max_model_len=64)


def _ok(llm):
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0))
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": []}, r"prompt is empty"),
    ({"prompt_token_ids": list(range(3, 70))}, r"prompt has 67 tokens, but max_model_len is 64"),
    ({"prompt_token_ids": [5, 320]}, r"token id 320 is outside the vocabulary \[0, 320\)"),
    ({"prompt_token_ids": [5, -1]}, r"token id -1 is outside the vocabulary"),
    ({"tokens": [1]}, r"prompts\[1\] must be a string or a dict"),
    ("hello", r"string prompts need a tokenizer"),
])
def test_bad_prompts_fail_cleanly_and_engine_keeps_serving(llm, prompt, match):
    before = _ok(llm)
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [5, 6]}, prompt], SamplingParams(max_tokens=3))
    assert _ok(llm) == before
    stats = llm.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["free_blocks"] == stats["total_blocks"]


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate([{"prompt_token_ids": [5]}] * 2, [SamplingParams()])


def test_unsupported_architecture_is_named(tmp_path):
    folder, _ = make_tiny_model("llama-tied-gqa", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture 'MambaForCausalLM'; "
                                         r"supported: DeepseekV3ForCausalLM, LlamaForCausalLM"):
        LLM(folder, dtype="float32")


def test_missing_weights_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = make_tiny_model("llama-tied-gqa", tmp_path)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file({k: v.contiguous() for k, v in tensors.items()}, path,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.up_proj"):
        LLM(folder, dtype="float32")
    path.unlink()
    with pytest.raises(FileNotFoundError, match=r"has no \*\.safetensors weights"):
        LLM(folder, dtype="float32")



def test_missing_folder_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(tmp_path / "nowhere")
    folder, _ = make_tiny_model("llama-tied-gqa", tmp_path)
    shutil.copytree(folder, tmp_path / "copy")
    with pytest.raises(ValueError, match="dtype must be auto, float32, bfloat16"):
        LLM(tmp_path / "copy", dtype="int8")
