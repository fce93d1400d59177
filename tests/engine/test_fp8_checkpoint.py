"""FP8 block-quantized checkpoints (DeepSeek's `weight_scale_inv` format, engine/models/fp8.py)
load by dequantizing at load: a tiny model quantized to float8_e4m3fn with block scales
(blocks that do not divide the weights, so the cut-short edge blocks are exercised) gives
the same weights, bit for bit, and the same greedy tokens as its dequantized float32 twin."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models import fp8
from tests.tiny_models import make_tiny_model, random_prompts

BLOCK = (16, 24)      # hidden 64, head_dim 24: partial blocks on both axes


def _quantize(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv) with per-block amax scaling, as DeepSeek's tool does."""
    out, inp = w.shape
    rows, cols = -(-out // block[0]), -(-inp // block[1])
    scale = torch.empty(rows, cols)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = \
                (tile / s).to(torch.float8_e4m3fn)
    return q, scale


@pytest.fixture(scope="module", params=["qwen3-qknorm-hd24", "deepseek-v3-mla"])
def pair(tmp_path_factory, request):
    """DeepSeek-V3: its MLA projections (kv_b_proj included) and MoE router quantized as
    DeepSeek ships them."""
    root = tmp_path_factory.mktemp("fp8")
    base, _ = make_tiny_model(request.param, root)
    tensors = load_file(str(base / "model.safetensors"))
    quant, twin = {}, {}
    for name, t in tensors.items():
        if name.endswith("proj.weight") and t.dim() == 2:
            q, s = _quantize(t.float())
            quant[name], quant[f"{name}_scale_inv"] = q, s
            twin[name] = fp8.dequantize(q, s, BLOCK)
        else:
            quant[name] = twin[name] = t
    folders = {}
    for kind, weights in (("fp8", quant), ("twin", twin)):
        folder = root / kind
        shutil.copytree(base, folder)
        (folder / "model.safetensors").unlink()
        save_file(weights, str(folder / "model.safetensors"))
        cfg = json.loads((folder / "config.json").read_text())
        if kind == "fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                          "weight_block_size": list(BLOCK)}
        (folder / "config.json").write_text(json.dumps(cfg))
        folders[kind] = folder
    return folders


def test_dequantize_matches_block_by_block():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 50, generator=gen)
    q, s = _quantize(w)
    got = fp8.dequantize(q, s, BLOCK)
    for i in range(3):
        for j in range(3):
            rows, cols = slice(i * 16, (i + 1) * 16), slice(j * 24, (j + 1) * 24)
            assert torch.equal(got[rows, cols], q[rows, cols].float() * s[i, j])
    assert (got - w).abs().max() <= w.abs().max() / 8      # e4m3 keeps 3 mantissa bits
    with pytest.raises(ValueError, match=r"needs \(3, 3\)"):
        fp8.dequantize(q, s[:2], BLOCK)


def test_an_fp8_checkpoint_gives_its_dequantized_twins_weights_and_tokens(pair):
    kw = dict(dtype="float32", num_gpu_blocks=64, enable_prefix_caching=False)
    fp8_llm, twin_llm = LLM(str(pair["fp8"]), **kw), LLM(str(pair["twin"]), **kw)
    a = dict(fp8_llm.engine.model.named_parameters())
    b = dict(twin_llm.engine.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, [5, 9, 17], 320, seed=4)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    got = [o.outputs[0].token_ids for o in fp8_llm.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in twin_llm.generate(prompts, params)]
    assert got == want


def test_an_fp8_weight_without_its_scales_is_named(pair, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(pair["fp8"], folder)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="o_proj.weight is torch.float8_e4m3fn but the "
                                         "checkpoint has no .*o_proj.weight_scale_inv"):
        LLM(str(folder), dtype="float32", num_gpu_blocks=16)
