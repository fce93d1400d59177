"""FP8 block-quantized checkpoints (DeepSeek-V3's format), dequantized at load.

DeepSeek ships its linear weights as float8_e4m3fn with a float32 `<name>_scale_inv` beside
each: one scale per block of `weight_block_size` (128 x 128) elements, the last blocks of a
row or column cut short; the weight's value is fp8 x scale (the name says inverse because
the quantizer divided by it). On devices without FP8 compute (CPUs, older GPUs, NPUs) the
loader multiplies it out once, in float32, then casts to the model's dtype, so the model
runs exactly as on the dequantized bf16 checkpoint DeepSeek also publishes.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_BLOCK = (128, 128)


def block_size(raw_config: dict) -> tuple[int, int]:
    """`quantization_config.weight_block_size`, else DeepSeek's 128 x 128."""
    q = raw_config.get("quantization_config") or {}
    size = q.get("weight_block_size") or DEFAULT_BLOCK
    if len(size) != 2 or any(not isinstance(b, int) or b < 1 for b in size):
        raise ValueError(f"quantization_config.weight_block_size {size!r}: expected two "
                         "positive integers")
    return int(size[0]), int(size[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor,
               block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """float32 weight of an FP8 [out, in] tensor and its [ceil(out/b0), ceil(in/b1)]
    scales."""
    out, inp = weight.shape
    rows, cols = -(-out // block[0]), -(-inp // block[1])
    if tuple(scale_inv.shape) != (rows, cols):
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, a {out} x {inp} "
                         f"weight in {block[0]} x {block[1]} blocks needs ({rows}, {cols})")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out]
    scale = scale.repeat_interleave(block[1], 1)[:, :inp]
    return weight.float() * scale


def read(handles: dict, name: str, block: tuple[int, int]) -> torch.Tensor:
    """Checkpoint tensor `name`, dequantized when it is FP8 (its scales must be there)."""
    t = handles[name].get_tensor(name)
    if t.dtype not in FP8_DTYPES:
        return t
    scale_name = f"{name}_scale_inv"
    if scale_name not in handles:
        raise ValueError(f"weight {name} is {t.dtype} but the checkpoint has no "
                         f"{scale_name} (FP8 weights need their block scales)")
    return dequantize(t, handles[scale_name].get_tensor(scale_name), block)
