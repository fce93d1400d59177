"""bf16 prefill attention takes the fastest path that runs here (engine/layers/
attention_choice.py): the choice follows the timings (injected, never taken), is kept for
the machine so a second engine reads it, skips a path that fails, and every path computes
the same attention within bf16's rounding; float32 and a forced path are never measured."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine.layers import attention_choice, cpu_prefill_attention, kernel_select
from engine.layers.kernel_options import DEFAULT_KERNELS, KernelOptions
from engine.layers.sdpa_attention import SdpaAttention
from tests.cpu_features import requires_avx512_bf16

HQ, HK, D, BS = 4, 2, 64, 16
CPU = torch.device("cpu")


def _timed_by(backend: SdpaAttention, seconds: dict[str, float], seen: list[str]):
    def timer(call):
        call()
        seen.append(backend.prefill_path)
        return seconds[backend.prefill_path]
    return timer


@requires_avx512_bf16
@pytest.mark.parametrize("fastest", ["tiles", "brgemm", "rows", "sdpa"])
def test_the_fastest_path_is_taken_and_kept_for_the_machine(fastest, choices, monkeypatch):
    backend = SdpaAttention(D ** -0.5)
    assert backend.prefill_paths(torch.bfloat16, CPU, D, HQ // HK, BS) == \
        ["tiles", "brgemm", "rows", "sdpa"]
    seconds = {"tiles": 2.0, "brgemm": 2.5, "rows": 3.0, "sdpa": 4.0, fastest: 1.0}
    seen: list[str] = []
    monkeypatch.setattr(kernel_select, "best_of", _timed_by(backend, seconds, seen))
    assert attention_choice.choose(backend, HQ, HK, D, BS, torch.bfloat16, CPU) == fastest
    assert backend.prefill_path == fastest
    assert sorted(seen) == ["brgemm", "rows", "sdpa", "tiles"]
    other = SdpaAttention(D ** -0.5)       # a second engine: the kept choice, not a timing
    seen.clear()
    assert attention_choice.choose(other, HQ, HK, D, BS, torch.bfloat16, CPU) == fastest
    assert seen == [] and other.prefill_path == fastest
    assert [v for k, v in choices.kept().items() if "prefill_attention" in k] == [fastest]


@requires_avx512_bf16
def test_a_path_that_fails_is_skipped_with_a_warning(choices, monkeypatch, caplog):
    backend = SdpaAttention(D ** -0.5)
    seen: list[str] = []
    monkeypatch.setattr(kernel_select, "best_of", _timed_by(
        backend, {"tiles": 1.0, "brgemm": 1.5, "rows": 3.0, "sdpa": 2.0}, seen))

    def broken(*args, **kwargs):
        raise RuntimeError("the tile kernel crashed")

    def broken_brgemm(*args, **kwargs):
        raise RuntimeError("the brgemm micro-kernel crashed")
    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention", broken)
    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention_brgemm", broken_brgemm)
    with caplog.at_level(logging.WARNING, logger="engine.layers.kernel_select"):
        assert attention_choice.choose(backend, HQ, HK, D, BS, torch.bfloat16, CPU) == "sdpa"
    for path in ("tiles", "brgemm"):
        assert any(path in r.getMessage() and "crashed" in r.getMessage()
                   for r in caplog.records), path


def test_float32_and_a_forced_path_are_not_measured(choices, monkeypatch):
    def no_timing(call):
        raise AssertionError("measured")
    monkeypatch.setattr(kernel_select, "best_of", no_timing)
    backend = SdpaAttention(D ** -0.5)
    assert attention_choice.choose(backend, HQ, HK, D, BS, torch.float32, CPU) is None
    assert backend.prefill_path is None
    assert backend.prefill_paths(torch.float32, CPU, D, HQ // HK, BS) == ["sdpa"]
    forced = SdpaAttention(D ** -0.5, replace(DEFAULT_KERNELS, cpu_prefill_attention="rows"))
    assert attention_choice.choose(forced, HQ, HK, D, BS, torch.bfloat16, CPU) is None
    assert forced.prefill_path == "rows" and choices.kept() == {}


def test_the_environment_forces_a_path_or_names_a_bad_one():
    env = {"PDSERVE_CPU_PREFILL_ATTENTION": "sdpa"}
    assert KernelOptions.from_env(env).cpu_prefill_attention == "sdpa"
    assert KernelOptions.from_env({}).cpu_prefill_attention == "measure"
    with pytest.raises(ValueError, match="PDSERVE_CPU_PREFILL_ATTENTION='amx'"):
        KernelOptions.from_env({"PDSERVE_CPU_PREFILL_ATTENTION": "amx"})


@requires_avx512_bf16
@torch.inference_mode()
def test_every_path_computes_the_attention():
    """Each candidate on the timed batch (a fresh prompt and a chunk after cached tokens)
    against float32 causal attention: bf16 inputs, so within bf16's rounding of the
    output (2^-8 relative) plus the bf16 probabilities of the tile and brgemm kernels."""
    meta, blocks = attention_choice.timed_batch(BS)
    gen = torch.Generator().manual_seed(1)
    t = sum(n for n, _ in attention_choice.TIMED_ROWS)
    q = torch.randn(t, HQ, D, generator=gen).bfloat16()
    k_all = {i: torch.randn(ctx + n, HK, D, generator=gen).bfloat16()
             for i, (n, ctx) in enumerate(attention_choice.TIMED_ROWS)}
    v_all = {i: torch.randn(ctx + n, HK, D, generator=gen).bfloat16()
             for i, (n, ctx) in enumerate(attention_choice.TIMED_ROWS)}
    want, k_new, v_new = [], [], []
    tok = 0
    for i, (n, ctx) in enumerate(attention_choice.TIMED_ROWS):
        qi = q[tok:tok + n].float().transpose(0, 1)[None]
        ki = k_all[i].float().transpose(0, 1)[None].repeat_interleave(HQ // HK, dim=1)
        vi = v_all[i].float().transpose(0, 1)[None].repeat_interleave(HQ // HK, dim=1)
        mask = torch.arange(ctx + n)[None, :] <= torch.arange(ctx, ctx + n)[:, None]
        want.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                   scale=D ** -0.5)[0].transpose(0, 1))
        k_new.append(k_all[i][ctx:])
        v_new.append(v_all[i][ctx:])
        tok += n
    want = torch.cat(want)
    for path in ("tiles", "brgemm", "rows", "sdpa"):
        backend = SdpaAttention(D ** -0.5, replace(DEFAULT_KERNELS, cpu_prefill_attention=path))
        kc = torch.zeros(HK, blocks, BS, D, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        for i, (_, ctx) in enumerate(attention_choice.TIMED_ROWS):   # the cached tokens
            table = meta.block_tables[i]
            for p in range(ctx):
                kc[:, table[p // BS], p % BS] = k_all[i][p]
                vc[:, table[p // BS], p % BS] = v_all[i][p]
        got = backend(q, torch.cat(k_new), torch.cat(v_new), kc, vc, meta)
        assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2), path
