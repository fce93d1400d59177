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
        return _DTYPES[requested]
    dtype = _DTYPES.get(str(model_dtype).replace("torch.", ""), torch.float32)
    if device.is_cpu and dtype is not torch.float32:
        if not cpu_has_native_bf16():
            log.info("dtype auto: this CPU has no native bf16 (%s); computing in float32",
                     torch.backends.cpu.get_cpu_capability())
            return torch.float32
        return torch.bfloat16        # fp16 matmuls are very slow on CPUs
    return dtype
