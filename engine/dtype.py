"""The compute dtype an engine runs in, from the config's request and the model folder."""

from __future__ import annotations

import logging

import torch

from engine.device import Device

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


def resolve_dtype(requested: str, model_dtype: str | None, device: Device) -> torch.dtype:
    """`auto` takes the folder's dtype, except on a CPU that lacks native half-precision
    matmuls (AVX2 only), where float32 is several times faster than emulated bf16/fp16."""
    if requested != "auto":
        dtype = _DTYPES[requested]
        if device.is_cpu:
            _warn_slow_cpu_dtype(dtype)
        return dtype
    dtype = _DTYPES.get(str(model_dtype).replace("torch.", ""), torch.float32)
    if device.is_cpu and dtype is not torch.float32:
        if not cpu_has_native_bf16():
            log.info("dtype auto: this CPU has no native bf16 (%s); computing in float32",
                     torch.backends.cpu.get_cpu_capability())
            return torch.float32
        return torch.bfloat16        # fp16 matmuls are very slow on CPUs
    return dtype


def _warn_slow_cpu_dtype(dtype: torch.dtype) -> None:
    """An explicit half-precision dtype the CPU can only emulate runs many times slower
    than float32 (measured with the ISA held to AVX2: bf16 33 tok/s against float32's 156
    on SmolLM2; fp16 slower still): say so once at load, with what to use instead."""
    if dtype is torch.float16:
        log.warning("dtype float16 on a CPU: CPUs have no fast float16 matmuls, so expect "
                    "it to be far slower than bfloat16 or float32 (--dtype auto picks "
                    "the fast one for this CPU)")
    elif dtype is torch.bfloat16 and not cpu_has_native_bf16():
        log.warning("dtype bfloat16 on a CPU without native bf16 (%s): its matmuls are "
                    "emulated, expect it several times slower than float32 (--dtype auto "
                    "picks float32 here)", torch.backends.cpu.get_cpu_capability())
