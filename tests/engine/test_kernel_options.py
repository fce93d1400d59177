"""KernelOptions: the CPU kernel choice is a value, read from the user's switches once when
the model is loaded and settled by each layer at construction. Nothing in the forward
reads the environment or a global switch, and both choices compute the same thing (the
fused ops bit for bit, tests/engine/test_cpu_fused_ops.py; greedy tokens equal to HF's)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers import cpu_fused_ops, cpu_paged_attention
from engine.layers.kernel_options import KernelOptions
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.layers.sdpa_attention import SdpaAttention
from tests.tiny_models import hf_greedy, make_tiny_model, random_prompts

ON, OFF = KernelOptions(), KernelOptions.torch_only()


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_fused_ops.available(), cpu_fused_ops.EXTENSION.failed
    assert cpu_paged_attention.kernel() is not None, cpu_paged_attention.EXTENSION.failed


def _counting(monkeypatch, module, name: str) -> list:
    """Count the calls of module.name (still calling it)."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    return calls


def test_from_env_reads_the_user_switches():
    assert KernelOptions.from_env({}) == ON
    assert KernelOptions.from_env({"PDSERVE_CPU_ATTENTION_KERNEL": "0"}) == \
        KernelOptions(cpu_attention_kernel=False)
    assert KernelOptions.from_env({"PDSERVE_CPU_FUSED_OPS": "0"}) == \
        KernelOptions(cpu_fused_ops=False)
    assert KernelOptions.from_env({"PDSERVE_CPU_FUSED_OPS": "1",
                                   "PDSERVE_CPU_ATTENTION_KERNEL": "yes"}) == ON
    with pytest.raises(dataclasses.FrozenInstanceError):
        ON.cpu_fused_ops = False


def test_the_cpu_kernels_stay_on_cpu():
    assert ON.for_device("cpu") == ON
    gpu = ON.for_device("cuda")
    assert not gpu.cpu_attention_kernel and not gpu.cpu_fused_ops


def test_layers_settle_their_choice_at_construction(monkeypatch):
    for options, on in ((ON, True), (OFF, False)):
        assert RMSNorm(8, 1e-5, options).fused_add is on
        assert RotaryEmbedding(8, 16, 1e4, kernels=options).fused is on
        attn = SdpaAttention(1.0, options)
        assert (attn.use_cpu_kernel, attn.fused_write, attn.grouped_decode) == (on, on, on)
    # an extension that cannot be built turns the choice off, whatever the options say
    monkeypatch.setattr(cpu_fused_ops, "available", lambda: False)
    assert not RMSNorm(8, 1e-5, ON).fused_add
    assert not RotaryEmbedding(8, 16, 1e4, kernels=ON).fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_owns_the_fused_rope(dtype, monkeypatch):
    calls = _counting(monkeypatch, cpu_fused_ops, "rope_")
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, t = 4, 2, 16, 5
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d, generator=g) * 3).to(dtype)
    positions = torch.randint(1, 64, (t,), generator=g)
    got = {}
    for name, options in (("fused", ON), ("torch", OFF)):
        rot = RotaryEmbedding(d, 64, 1e4, kernels=options)
        x = qkv.clone()
        with torch.inference_mode():
            q, k = rot.rotate_qkv(x, positions, heads, kv_heads)
        assert q.shape == (t, heads, d) and k.shape == (t, kv_heads, d)
        got[name] = q, k, x
    assert calls == [1]                                 # the fused layer only
    assert torch.equal(got["fused"][0], got["torch"][0])
    assert torch.equal(got["fused"][1], got["torch"][1])
    assert torch.equal(got["torch"][2], qkv)            # the torch path leaves qkv alone
    assert not torch.equal(got["fused"][2], qkv)        # the kernel rotated in place...
    qk = (heads + kv_heads) * d
    assert torch.equal(got["fused"][2][:, qk:], qkv[:, qk:])    # ...q and k, not v


def test_norm_owns_the_fused_add(monkeypatch):
    calls = _counting(monkeypatch, cpu_fused_ops, "add_rms_norm")
    g = torch.Generator().manual_seed(4)
    x, res = ((torch.randn(3, 64, generator=g) * 2).bfloat16() for _ in range(2))
    got = []
    for options in (ON, OFF):
        norm = RMSNorm(64, 1e-5, options).bfloat16()
        with torch.inference_mode():
            got.append(norm.add(x, res))
    assert calls == [1]
    assert torch.equal(got[0][1], got[1][1])            # the residual add is exact
    torch.testing.assert_close(got[0][0], got[1][0])    # the norm within bfloat16 rounding
    with torch.inference_mode():                        # float32 keeps torch's norm
        RMSNorm(64, 1e-5, ON).add(x.float(), res.float())
    assert calls == [1]


def test_engine_reads_the_switches_once_when_built(monkeypatch, tmp_path):
    """Switched off in the environment when the engine is built: every layer runs the
    torch ops, and switching the environment back later changes nothing."""
    folder, hf = make_tiny_model("llama-tied-gqa", tmp_path)
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION_KERNEL", "0")
    monkeypatch.setenv("PDSERVE_CPU_FUSED_OPS", "0")
    llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=64)
    model = llm.engine.model
    assert model.kernels == KernelOptions(cpu_attention_kernel=False, cpu_fused_ops=False)
    layer = model.layers[0]
    assert not (layer.input_layernorm.fused_add or layer.self_attn.rotary.fused
                or model.attention.use_cpu_kernel or model.attention.fused_write)
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION_KERNEL", "1")
    monkeypatch.setenv("PDSERVE_CPU_FUSED_OPS", "1")
    for name in ("rope_", "write_kv", "add_rms_norm"):
        monkeypatch.setattr(cpu_fused_ops, name, lambda *a: pytest.fail("a fused op ran"))
    monkeypatch.setattr(cpu_paged_attention, "paged_decode_attention",
                        lambda *a: pytest.fail("the C++ attention kernel ran"))
    prompts = random_prompts(3, [3, 9, 17], hf.config.vocab_size, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0.0))
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)[0]
