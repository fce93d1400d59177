"""Paged attention in plain torch: scaled_dot_product_attention over gathered blocks.

Decode rows are batched: their blocks are gathered through the block table into
[B, W*block_size] keys and masked by sequence length (fixed shapes for a fixed W, so the
path is graph-safe). Prefill rows run one sequence at a time with a causal mask offset by
the tokens already cached (prefix hits, earlier chunks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.forward_input import AttentionMetadata


class SdpaAttention:
    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        num_dec = meta.num_decodes + meta.num_padding
        if num_dec:
            out[:num_dec] = self._decode(q[:num_dec], k_cache, v_cache,
                                         meta.block_tables[:num_dec], meta.seq_lens[:num_dec])
        if meta.num_prefills:
            self._prefill(q, k, v, k_cache, v_cache, meta, out)
        return out

    def _decode(self, q, k_cache, v_cache, block_tables, seq_lens) -> torch.Tensor:
        b, w = block_tables.shape
        bs, hk, d = k_cache.shape[1:]
        idx = block_tables.reshape(-1)
        keys = k_cache.index_select(0, idx).view(b, w * bs, hk, d).transpose(1, 2)
        vals = v_cache.index_select(0, idx).view(b, w * bs, hk, d).transpose(1, 2)
        mask = torch.arange(w * bs, device=q.device)[None, :] < seq_lens[:, None]
        if q.device.type == "cpu":
            return self._decode_grouped(q, keys, vals, mask)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, vals, attn_mask=mask[:, None, None, :], scale=self.scale,
            enable_gqa=True)
        return o.squeeze(2)

    def _decode_grouped(self, q, keys, vals, mask) -> torch.Tensor:
        """One query row per sequence: two batched matmuls over [B, Hkv] with the query
        heads of a KV head as rows. On CPU the flash kernel pays its tiling for a single
        row and half precision adds conversions; this is ~2x faster there (measured in
        bench/offline_throughput.py's decode step). Softmax in float32."""
        b, hk = keys.shape[0], keys.shape[1]
        hq, d = q.shape[1], q.shape[2]
        qg = q.reshape(b, hk, hq // hk, d)
        scores = torch.matmul(qg, keys.transpose(2, 3)).float() * self.scale
        scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vals.dtype)
        return torch.matmul(probs, vals).reshape(b, hq, d)

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, out) -> None:
        bs, hk, d = k_cache.shape[1:]
        tok = meta.num_decodes
        first = meta.num_decodes
        for i in range(first, first + meta.num_prefills):
            n, ctx = meta.query_lens_host[i], meta.context_lens_host[i]
            # 4-D [1, H, n, D]: 3-D inputs fall back to a much slower kernel on CPU
            qi = q[tok:tok + n].transpose(0, 1)[None]
            if ctx == 0:
                ki = k[tok:tok + n].transpose(0, 1)[None]
                vi = v[tok:tok + n].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True,
                                                   scale=self.scale, enable_gqa=True)
            else:
                total = ctx + n
                nb = -(-total // bs)
                blocks = meta.block_tables[i, :nb]
                ki = k_cache[blocks].view(nb * bs, hk, d)[:total].transpose(0, 1)[None]
                vi = v_cache[blocks].view(nb * bs, hk, d)[:total].transpose(0, 1)[None]
                rows = torch.arange(ctx, total, device=q.device)[:, None]
                mask = torch.arange(total, device=q.device)[None, :] <= rows
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                   scale=self.scale, enable_gqa=True)
            out[tok:tok + n] = o[0].transpose(0, 1)
            tok += n

