"""Paged attention in plain torch: scaled_dot_product_attention over gathered blocks.

Decode rows are batched: their blocks are gathered through the block table into
[Hkv, B, W*block_size, D] keys (the head-major cache makes that a plain gather, see
engine/kv_cache.py) and masked by sequence length (fixed shapes for a fixed W, so the
path is graph-safe). A decode sequence may own Q > 1 rows (a speculative verify: the
current token and k drafts, Q = k+1, the same for every sequence): row j of a sequence
sees a KV length of seq_len - (Q-1-j), the mask built from the seq_lens tensor. Prefill
rows run one sequence at a time with a causal mask offset by the tokens already cached
(prefix hits, earlier chunks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.forward_input import AttentionMetadata
from engine.kv_cache import write_slots
from engine.layers import cpu_fused_ops, cpu_paged_attention
from engine.layers.decode_plan import DecodeGroup, build_plan, verify_kv_lens

__all__ = ["SdpaAttention", "verify_kv_lens"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16)     # what the C++ kernel is built for


class SdpaAttention:
    # decode on CPU through the C++ paged kernel when it builds (engine/layers/
    # cpu_paged_attention.py), else through the grouped matmuls (off: the SDPA kernel)
    cpu_kernel = True
    cpu_grouped_decode = True

    def __init__(self, scale: float):
        self.scale = scale
        self._plan: tuple | None = None     # (meta, rows, plan) of the current forward

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if cpu_fused_ops.usable(k, cpu_fused_ops.EXACT_DTYPES):
            cpu_fused_ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_slots(k_cache, meta.slot_mapping, k)
            write_slots(v_cache, meta.slot_mapping, v)
        num_dec = meta.num_decodes + meta.num_padding
        if not meta.num_prefills:
            return self._decode_rows(q, k_cache, v_cache, meta, num_dec)
        out = torch.empty_like(q)
        if num_dec:
            dec = self._decode_rows(q, k_cache, v_cache, meta, num_dec)
            out[:dec.shape[0]] = dec
        self._prefill(q, k, v, k_cache, v_cache, meta, out)
        return out

    def _decode_rows(self, q, k_cache, v_cache, meta: AttentionMetadata, num_dec: int
                     ) -> torch.Tensor:
        # query rows per decode sequence (1, or k+1 in a speculative verify)
        rows = meta.num_decode_tokens // meta.num_decodes if meta.num_decodes else 1
        n = num_dec * rows
        if (q.device.type == "cpu" and self.cpu_kernel and q.dtype in KERNEL_DTYPES
                and cpu_paged_attention.kernel()):
            lens = meta.seq_lens[:num_dec]
            kv_lens = lens if rows == 1 else verify_kv_lens(lens, rows).reshape(-1)
            return cpu_paged_attention.paged_decode_attention(
                q[:n], k_cache, v_cache, meta.block_tables[:num_dec], kv_lens, rows,
                self.scale)
        c = self._plan
        if c is not None and c[0] is meta and c[1] == rows:
            plan = c[2]
        else:
            plan = build_plan(meta, num_dec, rows, k_cache.shape[2])
            # host-planned groups hold per-forward masks: keep them for the other layers
            self._plan = (meta, rows, plan) if meta.seq_lens_host else None
        if len(plan) == 1 and plan[0].q_rows is None:
            return self._decode(q[:n], k_cache, v_cache, plan[0], rows)
        out = torch.empty_like(q[:n])
        for g in plan:
            out.index_copy_(0, g.q_rows, self._decode(q.index_select(0, g.q_rows), k_cache,
                                                      v_cache, g, rows))
        return out

    def _decode(self, q, k_cache, v_cache, g: DecodeGroup, rows: int) -> torch.Tensor:
        """q [B*rows, Hq, D], `rows` consecutive query rows per sequence -> [B*rows, Hq, D]"""
        b, w = g.num_seqs, g.width
        hk, _, bs, d = k_cache.shape
        keys = k_cache.index_select(1, g.block_ids).view(hk, b, w * bs, d)   # [Hkv, B, L, D]
        vals = v_cache.index_select(1, g.block_ids).view(hk, b, w * bs, d)
        if q.device.type == "cpu" and self.cpu_grouped_decode:
            return self._decode_grouped(q, keys, vals, g.masked, rows)
        keys, vals = keys.transpose(0, 1), vals.transpose(0, 1)           # [B, Hkv, L, D]
        if rows == 1:
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, vals, attn_mask=~g.masked[:, None, None, :],
                scale=self.scale, enable_gqa=True)
            return o.squeeze(2)
        hq = q.shape[1]
        qs = q.view(b, rows, hq, d).transpose(1, 2)                       # [B, Hq, Q, D]
        o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=~g.masked[:, None],
                                           scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(b * rows, hq, d)

    def _decode_grouped(self, q, keys, vals, masked, rows: int = 1) -> torch.Tensor:
        """Two batched matmuls over Hkv*B, with the query heads of a KV head (times the
        sequence's `rows` query rows) as rows; keys/vals [Hkv, B, L, D] straight from the
        gather; `masked` True where a key is out of reach. On CPU the flash kernel pays
        its tiling for a few rows and half precision adds conversions; this is ~2x faster
        there (bench/offline_throughput.py's decode step). Softmax in float32."""
        hk, b, length, d = keys.shape
        hq = q.shape[1]
        g = hq // hk
        # [B*Q, Hkv*G, D] -> [Hkv, B, G*Q, D]: row g*Q + j is head g of query row j
        qg = q.view(b, rows, hk, g, d).permute(2, 0, 3, 1, 4).reshape(hk * b, g * rows, d)
        if rows == 1:
            masked = masked[None, :, None, :]                             # [1, B, 1, L]
        else:                                                             # [1, B, G*Q, L]
            masked = masked[:, None].expand(b, g, rows, length).reshape(1, b, g * rows, length)
        scores = torch.bmm(qg, keys.view(hk * b, length, d).transpose(1, 2)).float()
        scores = scores.view(hk, b, g * rows, length).mul_(self.scale)
        scores.masked_fill_(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vals.dtype).view(hk * b, g * rows, length)
        o = torch.bmm(probs, vals.view(hk * b, length, d)).view(hk, b, g, rows, d)
        return o.permute(1, 3, 0, 2, 4).reshape(b * rows, hq, d)

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, out) -> None:
        hk, _, bs, d = k_cache.shape
        tok = meta.num_decode_tokens
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
                ki = k_cache[:, blocks].view(hk, nb * bs, d)[None, :, :total]
                vi = v_cache[:, blocks].view(hk, nb * bs, d)[None, :, :total]
                rows = torch.arange(ctx, total, device=q.device)[:, None]
                mask = torch.arange(total, device=q.device)[None, :] <= rows
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                   scale=self.scale, enable_gqa=True)
            out[tok:tok + n] = o[0].transpose(0, 1)
            tok += n
