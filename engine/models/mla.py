"""Multi-head latent attention (DeepSeek-V3's MLA) over a latent paged KV cache.

What a token leaves in the cache is not per-head K and V but one row of `kv_lora_rank +
qk_rope_head_dim` values: the normalized KV latent `c` and the rotated, head-shared rope
key `k_pe`. The cache is the usual KVCache with one "head" of that width as K and no V
(`kv_cache_layout`): 576 values a token for DeepSeek-V3 instead of 2 x 128 x 192.

Two forms compute the same attention (scaled softmax of q.k over the context, times v):

- **Expanded** (prefill rows): the context's latents go through `kv_b_proj` into per-head
  K_nope and V, the head-shared k_pe is appended to every head's K, and SDPA runs over
  [ctx + n] keys, as HF does. Chunked prefill and prefix hits read the earlier latents
  from the cache like any other context.
- **Absorbed** (decode rows): W_UK (the K_nope half of `kv_b_proj`) is folded into the
  query, q_lat[h] = q_nope[h] @ W_UK[h], so scores are q_lat . c + q_pe . k_pe straight
  against the cached latents, and W_UV is applied after attention to the attended latent.
  Per token this reads R + P values instead of H x (nope + rope + v), the reason MLA
  exists. It differs from the expanded form only in float rounding (the products are
  associated differently): tests/engine/test_mla.py states the tolerance.

Decode rows are computed from tensors only (block tables and KV lengths, padding rows
included), so a graph's bound buffers drive them; prefill rows use the host lists of the
per-sequence path, as the SDPA backend's prefill does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import write_slots
from engine.layers import cpu_latent_attention
from engine.layers.decode_plan import verify_kv_lens
from engine.layers.kernel_options import DEFAULT_KERNELS, KernelOptions
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.mla_layout import mla_dims, softmax_scale


class DenseWeight(nn.Module):
    """A bare [out, in] weight used through F.linear and sliced per head (kv_b_proj: the
    absorbed decode needs W_UK and W_UV as dense tensors, so the loader must not pack it)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rope dims stored as pairs (x0, x1), (x2, x3)... -> (x0, x2, ..., x1, x3, ...): the
    rotate-half layout, in which HF's interleaved rotation computes the same products."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MlaAttention(nn.Module):
    """DeepSeek-V3's attention block; parameter names as HF's (the loader maps them 1:1)."""

    def __init__(self, cfg, rotary: RotaryEmbedding, kernels: KernelOptions = DEFAULT_KERNELS):
        super().__init__()
        raw, h = cfg.raw, cfg.hidden_size
        self.dims = d = mla_dims(raw, cfg.architecture)
        self.num_heads = hq = cfg.num_attention_heads
        self.qk_dim = d.nope + d.rope
        bias = bool(raw.get("attention_bias", False))
        if d.q_lora_rank is None:
            self.q_proj = Linear(h, hq * self.qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(h, d.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, cfg.rms_norm_eps, kernels)
            self.q_b_proj = Linear(d.q_lora_rank, hq * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, d.latent, bias=bias)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, cfg.rms_norm_eps, kernels)
        self.kv_b_proj = DenseWeight(hq * (d.nope + d.v), d.kv_lora_rank)
        self.o_proj = Linear(hq * d.v, h, bias=bias)
        self.interleave = bool(raw.get("rope_interleave", True))
        self.scale = softmax_scale(raw, d)
        self.rotary = rotary
        self.absorbed = kernels.mla_absorbed_decode
        # the absorbed decode through the C++ latent kernel on CPU, where measured faster
        # than the torch einsums (engine/models/mla_choice.py sets it when the cache is made)
        self.use_cpu_kernel = kernels.cpu_attention_kernel

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.dims.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x, positions, latent_cache, v_cache, plan):
        """latent_cache [1, blocks, block_size, R + P] (v_cache: the empty V of this
        layout). `plan`: the SDPA backend's plan of this forward, or bare metadata."""
        d, hq, t = self.dims, self.num_heads, x.shape[0]
        meta = getattr(plan, "meta", plan)
        q = self._query(x).view(t, hq, self.qk_dim)
        q_nope, q_pe = q.split([d.nope, d.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.rope], dim=-1)
        c = self.kv_a_layernorm(c)
        if self.interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.reshape(t, 1, d.rope))
        write_slots(latent_cache, meta.slot_mapping,
                    torch.cat((c, k_pe.reshape(t, d.rope)), dim=-1).view(t, 1, d.latent))
        out = x.new_empty(t, hq, d.v)
        num_dec = meta.num_decodes + meta.num_padding
        dec_rows = t if not meta.num_prefills else meta.num_decode_tokens
        if num_dec and dec_rows:
            decode = self._decode if self.absorbed else self._decode_expanded
            out[:dec_rows] = decode(q_nope[:dec_rows], q_pe[:dec_rows], latent_cache, meta,
                                    num_dec)
        if meta.num_prefills:
            self._prefill(q_nope, q_pe, latent_cache, meta, dec_rows, out)
        return self.o_proj(out.reshape(t, hq * d.v))

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dims
        w = self.kv_b_proj.weight.view(self.num_heads, d.nope + d.v, d.kv_lora_rank)
        return w[:, :d.nope], w[:, d.nope:]          # [H, nope, R], [H, v, R]

    def _decode_context(self, latent_cache, meta, num_dec: int, rows: int):
        """The decode sequences' cached latents [B, W*bs, R+P] and which of them each row
        sees [B, rows, W*bs] (row j of a sequence of KV length L sits at L - rows + j)."""
        tables = meta.block_tables[:num_dec].long()
        lat = latent_cache[0][tables].view(num_dec, -1, self.dims.latent)
        lens = meta.seq_lens[:num_dec].long()
        last = lens[:, None] - rows + torch.arange(rows, device=lens.device)[None, :]
        cols = torch.arange(lat.shape[1], device=lens.device)
        return lat, cols[None, None, :] <= last[:, :, None]

    @staticmethod
    def _softmax(scores, allowed, dtype: torch.dtype) -> torch.Tensor:
        """Attention weights [B, H, rows, L] over the keys each row sees, in float32."""
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(dtype)

    def _decode(self, q_nope, q_pe, latent_cache, meta, num_dec: int) -> torch.Tensor:
        """Absorbed form over each decode sequence's cached latents (tensors only)."""
        d, hq = self.dims, self.num_heads
        rows = q_nope.shape[0] // num_dec
        w_uk, w_uv = self._w_uk_uv()
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        if self.use_cpu_kernel and cpu_latent_attention.usable(latent_cache):
            lens = meta.seq_lens[:num_dec]
            kv_lens = lens if rows == 1 else verify_kv_lens(lens, rows).reshape(-1)
            o_lat = cpu_latent_attention.latent_decode_attention(
                q_lat, q_pe.contiguous(), latent_cache, meta.block_tables[:num_dec],
                kv_lens, rows, self.scale)
            return torch.einsum("thr,hvr->thv", o_lat, w_uv)
        q_lat = q_lat.view(num_dec, rows, hq, -1)
        q_pe = q_pe.reshape(num_dec, rows, hq, d.rope)
        lat, allowed = self._decode_context(latent_cache, meta, num_dec, rows)
        c, k_pe = lat[..., :d.kv_lora_rank], lat[..., d.kv_lora_rank:]
        scores = (torch.einsum("bqhr,blr->bhql", q_lat, c)
                  + torch.einsum("bqhp,blp->bhql", q_pe, k_pe)) * self.scale
        p = self._softmax(scores, allowed, c.dtype)
        o_lat = torch.einsum("bhql,blr->bqhr", p, c)
        return torch.einsum("bqhr,hvr->bqhv", o_lat, w_uv).reshape(num_dec * rows, hq, d.v)

    def _decode_expanded(self, q_nope, q_pe, latent_cache, meta, num_dec: int
                         ) -> torch.Tensor:
        """The expanded form on decode rows (kernels.mla_absorbed_decode off), from
        tensors too: every cached latent through kv_b_proj, then plain attention."""
        d, hq = self.dims, self.num_heads
        rows = q_nope.shape[0] // num_dec
        lat, allowed = self._decode_context(latent_cache, meta, num_dec, rows)
        kv = F.linear(lat[..., :d.kv_lora_rank], self.kv_b_proj.weight)
        k_nope, v = kv.view(num_dec, -1, hq, d.nope + d.v).split([d.nope, d.v], dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).view(num_dec, rows, hq, self.qk_dim)
        k_pe = lat[..., None, d.kv_lora_rank:].expand(-1, -1, hq, -1)
        k = torch.cat((k_nope, k_pe), dim=-1)                          # [B, L, H, qk]
        scores = torch.einsum("bqhd,blhd->bhql", q, k) * self.scale
        p = self._softmax(scores, allowed, v.dtype)
        return torch.einsum("bhql,blhv->bqhv", p, v).reshape(num_dec * rows, hq, d.v)

    def _prefill(self, q_nope, q_pe, latent_cache, meta, tok: int, out) -> None:
        """Expanded form, one sequence at a time, over its context and new rows."""
        d, hq = self.dims, self.num_heads
        bs = latent_cache.shape[2]
        first = meta.num_decodes
        for i in range(first, first + meta.num_prefills):
            n, ctx = meta.query_lens_host[i], meta.context_lens_host[i]
            total = ctx + n
            blocks = meta.block_tables[i, :-(-total // bs)].long()
            lat = latent_cache[0][blocks].reshape(-1, d.latent)[:total]
            kv = F.linear(lat[:, :d.kv_lora_rank], self.kv_b_proj.weight)
            k_nope, v = kv.view(total, hq, d.nope + d.v).split([d.nope, d.v], dim=-1)
            k = torch.cat((k_nope, lat[:, None, d.kv_lora_rank:].expand(total, hq, d.rope)),
                          dim=-1)
            qi = torch.cat((q_nope[tok:tok + n], q_pe[tok:tok + n]), dim=-1)
            qi, k, v = (a.transpose(0, 1)[None] for a in (qi, k, v))
            if ctx == 0:
                o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=self.scale)
            else:
                rows = torch.arange(ctx, total, device=qi.device)[:, None]
                mask = torch.arange(total, device=qi.device)[None, :] <= rows
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=self.scale)
            out[tok:tok + n] = o[0].transpose(0, 1)
            tok += n
