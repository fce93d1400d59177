"""The paged decode kernel's path is chosen by measurement (engine/layers/
decode_attention_choice.py): the faster of the paths that run here is taken (timings
injected, never taken) and kept for the machine so a second engine reads it; a path that
fails is skipped with a warning; a forced path is taken without timing, and a forced path
that cannot run here is refused with a warning; float32 (one path) is never measured."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.layers import (
    cpu_paged_attention,
    decode_attention_choice,
    kernel_select,
)
from engine.layers.kernel_options import DECODE_ATTENTION_ENV, KernelOptions
from engine.layers.sdpa_attention import SdpaAttention
from tests.cpu_features import requires_amx_bf16

HQ, HK, D, BS = 6, 2, 64, 16
CPU = torch.device("cpu")


@pytest.fixture
def timed(monkeypatch):
    """Paths the timed calls took, and a timer reading their seconds from `seconds`."""
    calls: list[str] = []
    real = cpu_paged_attention.paged_decode_attention

    def spy(*args):
        calls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(cpu_paged_attention, "paged_decode_attention", spy)

    def use(seconds: dict[str, float]) -> list[str]:
        def timer(call):
            start = len(calls)
            call()
            (path,) = set(calls[start:])        # one timed pass is one path's calls
            return seconds[path]
        monkeypatch.setattr(kernel_select, "best_of", timer)
        return calls
    return use


@requires_amx_bf16
@pytest.mark.parametrize("fastest", ["vector", "amx"])
def test_the_faster_path_is_taken_and_kept_for_the_machine(fastest, choices, timed):
    backend = SdpaAttention(D ** -0.5)
    assert decode_attention_choice.paths_for(backend, D, HQ // HK, BS, torch.bfloat16,
                                             CPU) == ["vector", "amx"]
    calls = timed({"vector": 2.0, "amx": 3.0, fastest: 1.0})
    assert decode_attention_choice.choose(backend, HQ, HK, D, BS, torch.bfloat16,
                                          CPU) == fastest
    assert backend.decode_path == fastest and {"vector", "amx"} <= set(calls)
    other = SdpaAttention(D ** -0.5)        # a second engine: the kept choice, not a timing
    calls.clear()
    assert decode_attention_choice.choose(other, HQ, HK, D, BS, torch.bfloat16,
                                          CPU) == fastest
    assert calls == [] and other.decode_path == fastest
    assert [v for k, v in choices.kept().items() if "paged_decode_attention" in k] == [fastest]


@requires_amx_bf16
def test_a_path_that_fails_is_skipped_with_a_warning(choices, monkeypatch, caplog):
    backend = SdpaAttention(D ** -0.5)
    real = cpu_paged_attention.paged_decode_attention

    def broken(*args):
        if args[-1] == "amx":
            raise RuntimeError("no tiles today")
        return real(*args)

    monkeypatch.setattr(cpu_paged_attention, "paged_decode_attention", broken)
    monkeypatch.setattr(kernel_select, "best_of", lambda call: call() or 1.0)
    with caplog.at_level(logging.WARNING):
        assert decode_attention_choice.choose(backend, HQ, HK, D, BS, torch.bfloat16,
                                              CPU) == "vector"
    assert backend.decode_path == "vector"
    assert "candidate amx skipped" in caplog.text and "no tiles today" in caplog.text


def test_a_forced_path_is_taken_without_timing(choices, timed, monkeypatch):
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "vector")
    backend = SdpaAttention(D ** -0.5, KernelOptions.from_env())
    calls = timed({"vector": 1.0, "amx": 1.0})
    assert decode_attention_choice.choose(backend, HQ, HK, D, BS, torch.bfloat16,
                                          CPU) == "vector"
    assert backend.decode_path == "vector" and calls == [] and choices.kept() == {}


@pytest.mark.parametrize("dtype,bs", [(torch.float32, 16), (torch.bfloat16, 8)])
def test_a_forced_tile_path_that_cannot_run_is_refused(dtype, bs, choices, monkeypatch,
                                                       caplog):
    """float32 caches, or blocks of fewer than 16 keys: the tile path does not fit (nor
    anywhere on a CPU without AMX), so the vector path stays, with a warning."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "amx")
    backend = SdpaAttention(D ** -0.5, KernelOptions.from_env())
    with caplog.at_level(logging.WARNING):
        assert decode_attention_choice.choose(backend, HQ, HK, D, bs, dtype, CPU) is None
    assert backend.decode_path == "vector"
    assert "'amx' was asked for but does not run" in caplog.text


def test_float32_has_one_path_and_is_not_measured(choices, timed):
    backend = SdpaAttention(D ** -0.5)
    calls = timed({"vector": 1.0, "amx": 1.0})
    assert decode_attention_choice.paths_for(backend, D, HQ // HK, BS, torch.float32,
                                             CPU) == ["vector"]
    assert decode_attention_choice.choose(backend, HQ, HK, D, BS, torch.float32, CPU) is None
    assert backend.decode_path == "vector" and calls == [] and choices.kept() == {}


def test_an_unknown_forced_path_is_an_error():
    with pytest.raises(ValueError, match="PDSERVE_CPU_DECODE_ATTENTION='tiles'"):
        KernelOptions.from_env({DECODE_ATTENTION_ENV: "tiles"})
