"""Rotary position embedding (rotate-half layout), cos/sin tables built once in float32.

Scaling types as HF's configs name them: default, linear, llama3, yarn. The tables are
indexed by position, so the decode path has no data-dependent shapes.

`rotate_qkv` rotates q and k where they sit in a fused qkv projection's output: on CPU
through the fused C++ rope (engine/layers/cpu_fused_ops.py, in place, one call, the same
rounding) when the layer's KernelOptions turn it on, else through the torch ops.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers import cpu_fused_ops
from engine.layers.kernel_options import DEFAULT_KERNELS, KernelOptions

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _inv_freq(head_dim: int, theta: float, scaling: dict | None,
              max_pos: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq, attention_scaling)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rtype = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rtype == "default":
        return inv, 1.0
    factor = float(scaling["factor"])
    if rtype == "linear":
        return inv / factor, 1.0
    if rtype == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, out), 1.0
    if rtype == "yarn":
        old_len = scaling.get("original_max_position_embeddings") or max_pos / factor
        beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)
        def get_mscale(m: float = 1.0) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
        mscale = scaling.get("attention_factor")
        if mscale is None:      # DeepSeek: the ratio of its two mscales (1 when equal)
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            mscale = get_mscale(m) / get_mscale(m_all) if m and m_all else get_mscale()

        def dim_of(rot: float) -> float:
            return (head_dim * math.log(old_len / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = dim_of(beta_fast), dim_of(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low))
        extrapolation = 1 - ramp.clamp(0, 1)
        pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        inv_extra, inv_inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        return inv_inter * (1 - extrapolation) + inv_extra * extrapolation, float(mscale)
    raise ValueError(f"rope scaling type {rtype!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict | None = None, kernels: KernelOptions = DEFAULT_KERNELS):
        super().__init__()
        inv, attn_scale = _inv_freq(head_dim, theta, scaling, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attn_scale, persistent=False)
        # rotate_half(x) * sin == x.roll(half) * [-sin_lo, sin_hi] exactly (a sign flip
        # commutes with rounding), one roll instead of slice/neg/cat
        sin = emb.sin() * attn_scale
        half = head_dim // 2
        self.register_buffer("sin_signed", torch.cat((-sin[:, :half], sin[:, half:]), -1),
                             persistent=False)
        self.head_dim, self.half = head_dim, half
        self._cached: tuple | None = None
        # the fused rope: decided once here (the option on and the extension built); a
        # call then checks only its input's device and dtype
        self.fused = kernels.cpu_fused_ops and cpu_fused_ops.available()

    def begin_forward(self) -> None:
        """Forget the previous forward's cos/sin: the model calls this first in every
        forward, so the lookup cache lives for one forward only. Across forwards it would
        be wrong on a GPU graph: the capture of a decode graph follows warm-up runs over
        the same positions buffer (same tensor, same version), so its lookup hit the
        warm-up's cache, the gather was never captured and every replay rotated by the
        warm-up's positions, read from a warm-up tensor that the next eager forward
        freed (a CPU "graph" reruns the Python, which hid it)."""
        self._cached = None

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin rows for `positions`, [T, 1, D] in `dtype`. Every layer of one forward
        passes the same positions tensor: the gather runs once per forward (the cache is
        dropped by `begin_forward`), keyed on the tensor and its version counter too, so
        an in-place write between two lookups is never served stale rows."""
        if positions.is_inference():    # no version counter: never cache
            self._cached = None
            return self._gather(positions, dtype)
        key = (positions, positions._version, dtype)
        c = self._cached
        if c is not None and c[0] is key[0] and c[1:3] == key[1:]:
            return c[3], c[4]
        cos, sin = self._gather(positions, dtype)
        self._cached = (*key, cos, sin)
        return cos, sin

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype):
        return (self.cos[positions].to(dtype).unsqueeze(1),
                self.sin_signed[positions].to(dtype).unsqueeze(1))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(self.half, dims=-1) * sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated (same dtype)."""
        cos, sin = self.lookup(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)

    def rotate_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, num_heads: int,
                   num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated, from a fused qkv output [T, (Hq +
        2 Hkv) * D] where they sit side by side (v is left alone). The fused rope writes
        them in place in qkv and returns views of it; the torch path rotates them as one
        tensor into a new one. Bit-identical results (tests/engine/test_cpu_fused_ops.py)."""
        t, d = qkv.shape[0], self.head_dim
        heads = num_heads + num_kv_heads
        qk = qkv[:, :heads * d].view(t, heads, d)
        if self.fused and cpu_fused_ops.fits(qkv, cpu_fused_ops.EXACT_DTYPES):
            cpu_fused_ops.rope_(qkv, positions, self.cos, self.sin_signed, heads, d)
        else:
            cos, sin = self.lookup(positions, qk.dtype)
            qk = self.rotate(qk, cos, sin)
        return qk.split([num_heads, num_kv_heads], dim=1)
