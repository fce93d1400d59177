"""The compute dtype from `--dtype` and the model folder (engine/dtype.py): `auto` keeps a
half-precision model in bf16 only where the CPU multiplies bf16 natively, and an explicit
dtype the CPU can only emulate is honoured with a warning that names the cost. The CPU's
capability is the boundary here, so it is patched."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import dtype as dtype_mod
from engine.device import Device

CPU = Device("cpu")


@pytest.fixture
def capability(monkeypatch):
    def set_to(value: str):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: value)
    return set_to


@pytest.mark.parametrize("cap, want", [("AVX2", torch.float32), ("AVX512", torch.bfloat16),
                                       ("DEFAULT", torch.float32)])
def test_auto_takes_bf16_only_where_native(capability, cap, want):
    capability(cap)
    assert dtype_mod.resolve_dtype("auto", "bfloat16", CPU) is want
    assert dtype_mod.resolve_dtype("auto", "float16", CPU) is want   # never fp16 on a CPU
    assert dtype_mod.resolve_dtype("auto", "float32", CPU) is torch.float32
    assert dtype_mod.resolve_dtype("auto", None, CPU) is torch.float32


def test_explicit_bf16_without_native_support_warns(capability, caplog):
    capability("AVX2")
    with caplog.at_level(logging.WARNING, logger="engine.dtype"):
        assert dtype_mod.resolve_dtype("bfloat16", "bfloat16", CPU) is torch.bfloat16
    [record] = [r for r in caplog.records if r.name == "engine.dtype"]
    assert "AVX2" in record.getMessage() and "float32" in record.getMessage()


def test_explicit_fp16_on_cpu_warns_and_native_bf16_does_not(capability, caplog):
    capability("AVX512")
    with caplog.at_level(logging.WARNING, logger="engine.dtype"):
        assert dtype_mod.resolve_dtype("bfloat16", None, CPU) is torch.bfloat16
        assert dtype_mod.resolve_dtype("float32", None, CPU) is torch.float32
        assert not [r for r in caplog.records if r.name == "engine.dtype"]
        assert dtype_mod.resolve_dtype("float16", None, CPU) is torch.float16
    [record] = [r for r in caplog.records if r.name == "engine.dtype"]
    assert "float16" in record.getMessage()
