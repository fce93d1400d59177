"""Paged attention in plain torch: scaled_dot_product_attention over gathered blocks.

Decode rows are batched: their blocks are gathered through the block table into
[Hkv, B, W*block_size, D] keys (the head-major cache makes that a plain gather, see
engine/kv_cache.py) and masked by sequence length (fixed shapes for a fixed W, so the
path is graph-safe). A decode sequence may own Q > 1 rows (a speculative verify: the
current token and k drafts, Q = k+1, the same for every sequence): row j of a sequence
sees a KV length of seq_len - (Q-1-j), the mask built from the seq_lens tensor. Prefill
rows run one sequence at a time with a causal mask offset by the tokens already cached
(prefix hits, earlier chunks).

`prepare(meta, k_cache)` runs once per forward, before the layers (the model's forward
calls it; a graph forward calls it inside the captured callable, so every replay
rebuilds it from the buffers' tensors): it decides how the decode rows are served and
builds what every layer shares (the C++ kernel's per-row KV lengths, or the torch path's
width groups and masks, engine/layers/decode_plan.py). The kernel choices themselves are
made at construction from a KernelOptions value (engine/layers/kernel_options.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.forward_input import AttentionMetadata
from engine.kv_cache import write_slots
from engine.layers import cpu_fused_ops, cpu_paged_attention, cpu_prefill_attention
from engine.layers.decode_plan import DecodeGroup, build_plan, verify_kv_lens
from engine.layers.kernel_options import DEFAULT_KERNELS, KernelOptions

__all__ = ["AttentionPlan", "SdpaAttention", "verify_kv_lens"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16)     # what the C++ kernel is built for


@dataclass
class AttentionPlan:
    """One forward's attention plan, shared by all its layers."""
    meta: AttentionMetadata
    rows: int                   # query rows per decode sequence (1, or k+1 in a verify)
    num_dec: int                # decode sequences, padding included
    # the C++ kernel serves the decode rows: the KV length of each query row
    kv_lens: torch.Tensor | None = None
    # else the torch path's width groups
    groups: list[DecodeGroup] | None = None
    # prefill rows through the kernel: (block table per row, KV length per row), built by
    # the first layer that needs them and reused by the others
    prefill_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # prefill rows through the tile kernel: (block tables, query starts, context lengths)
    prefill_tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class SdpaAttention:
    def __init__(self, scale: float, kernels: KernelOptions = DEFAULT_KERNELS):
        self.scale = scale
        # decided once here: decode on CPU through the C++ paged kernel when the option
        # is on and it builds (engine/layers/cpu_paged_attention.py), else the torch path:
        # grouped matmuls on CPU (or, that option off, the SDPA kernel as elsewhere)
        self.use_cpu_kernel = (kernels.cpu_attention_kernel
                               and cpu_paged_attention.kernel() is not None)
        self.grouped_decode = kernels.cpu_grouped_decode
        self.fused_write = kernels.cpu_fused_ops and cpu_fused_ops.available()
        self.rowwise_prefill = kernels.batch_invariant
        # bf16 prefill rows through the tile kernel (not in batch-invariant mode: its bits
        # are not the decode kernel's); shapes checked per call (`usable`)
        self.prefill_tiles = (kernels.cpu_prefill_tiles and self.use_cpu_kernel
                              and not kernels.batch_invariant
                              and cpu_prefill_attention.EXTENSION.load() is not None)
        # bf16 prefill's path: None takes the first that fits of tiles, rows, SDPA; a
        # forced or measured one (engine/layers/attention_choice.py) is set here
        self.prefill_path: str | None = (None if kernels.cpu_prefill_attention == "measure"
                                         else kernels.cpu_prefill_attention)
        # the paged kernel's path for decode rows (and batch-invariant prefill rows, whose
        # bits must be the decode rows'): "vector" until the KV cache is made, then the
        # forced or measured one (engine/layers/decode_attention_choice.py), set only where
        # it fits the caches
        self.decode_path = "vector"
        self.forced_decode_path: str | None = (None if kernels.cpu_decode_attention == "measure"
                                               else kernels.cpu_decode_attention)
        if self.rowwise_prefill and not self.use_cpu_kernel:
            raise RuntimeError(
                "batch_invariant needs the CPU paged attention kernel (a CPU device, the "
                "kernel built, PDSERVE_CPU_ATTENTION_KERNEL not 0); here it is "
                f"{cpu_paged_attention.EXTENSION.failed or 'switched off'}")

    def prepare(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> AttentionPlan:
        """The plan of one forward over `meta`, for layers whose caches are like
        `k_cache` [Hkv, blocks, block_size, D]. Host-planned width groups (eager
        forwards) hold this forward's masks; graph metadata gets one group from tensors."""
        num_dec = meta.num_decodes + meta.num_padding
        rows = meta.num_decode_tokens // meta.num_decodes if meta.num_decodes else 1
        plan = AttentionPlan(meta, rows, num_dec)
        if not num_dec:
            return plan
        if (self.use_cpu_kernel and k_cache.device.type == "cpu"
                and k_cache.dtype in KERNEL_DTYPES):
            lens = meta.seq_lens[:num_dec]
            plan.kv_lens = lens if rows == 1 else verify_kv_lens(lens, rows).reshape(-1)
        else:
            plan.groups = build_plan(meta, num_dec, rows, k_cache.shape[2])
        return plan

    def __call__(self, q, k, v, k_cache, v_cache,
                 plan: AttentionPlan | AttentionMetadata) -> torch.Tensor:
        """`plan` from `prepare`; bare metadata (a single layer, a test) is prepared here."""
        if isinstance(plan, AttentionMetadata):
            plan = self.prepare(plan, k_cache)
        meta = plan.meta
        if self.fused_write and cpu_fused_ops.fits(k, cpu_fused_ops.EXACT_DTYPES):
            cpu_fused_ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_slots(k_cache, meta.slot_mapping, k)
            write_slots(v_cache, meta.slot_mapping, v)
        if not meta.num_prefills:
            return self._decode_rows(q, k_cache, v_cache, plan)
        out = torch.empty_like(q)
        if plan.num_dec:
            dec = self._decode_rows(q, k_cache, v_cache, plan)
            out[:dec.shape[0]] = dec
        self._prefill(q, k, v, k_cache, v_cache, plan, out)
        return out

    def _decode_rows(self, q, k_cache, v_cache, plan: AttentionPlan) -> torch.Tensor:
        rows = plan.rows
        n = plan.num_dec * rows
        if plan.kv_lens is not None:
            return cpu_paged_attention.paged_decode_attention(
                q[:n], k_cache, v_cache, plan.meta.block_tables[:plan.num_dec],
                plan.kv_lens, rows, self.scale, self.decode_path)
        groups = plan.groups
        if len(groups) == 1 and groups[0].q_rows is None:
            return self._decode(q[:n], k_cache, v_cache, groups[0], rows)
        out = torch.empty_like(q[:n])
        for g in groups:
            out.index_copy_(0, g.q_rows, self._decode(q.index_select(0, g.q_rows), k_cache,
                                                      v_cache, g, rows))
        return out

    def _decode(self, q, k_cache, v_cache, g: DecodeGroup, rows: int) -> torch.Tensor:
        """q [B*rows, Hq, D], `rows` consecutive query rows per sequence -> [B*rows, Hq, D]"""
        b, w = g.num_seqs, g.width
        hk, _, bs, d = k_cache.shape
        keys = k_cache.index_select(1, g.block_ids).view(hk, b, w * bs, d)   # [Hkv, B, L, D]
        vals = v_cache.index_select(1, g.block_ids).view(hk, b, w * bs, d)
        if q.device.type == "cpu" and self.grouped_decode:
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

    def prefill_paths(self, dtype: torch.dtype, device: torch.device, head_dim: int,
                      groups: int, block_size: int) -> list[str]:
        """The prefill paths that run here for caches of this shape, default first: the
        tile kernel, the brgemm kernel, the decode kernel row by row (bf16 only: float32
        keeps SDPA, whose rounding is HF's), SDPA. A forced path that cannot run falls
        back to SDPA."""
        paths = []
        if device.type == "cpu" and self.prefill_tiles and cpu_prefill_attention.usable(
                dtype, head_dim, groups, block_size):
            paths.append("tiles")
        if device.type == "cpu" and self.prefill_tiles and cpu_prefill_attention.brgemm_usable(
                dtype, head_dim, groups):
            paths.append("brgemm")
        if device.type == "cpu" and self.use_cpu_kernel and \
                cpu_paged_attention.fast_bf16_rows(dtype, head_dim, groups):
            paths.append("rows")
        return paths + ["sdpa"]

    def _prefill(self, q, k, v, k_cache, v_cache, plan: AttentionPlan, out) -> None:
        meta = plan.meta
        if self.rowwise_prefill and k_cache.dtype in KERNEL_DTYPES:
            return self._prefill_rowwise(q, k_cache, v_cache, plan, out)
        paths = self.prefill_paths(k_cache.dtype, k_cache.device, k_cache.shape[3],
                                   q.shape[1] // k_cache.shape[0], k_cache.shape[2])
        path = self.prefill_path if self.prefill_path in paths else paths[0]
        if path in ("tiles", "brgemm"):
            return self._prefill_tiles(q, k_cache, v_cache, plan, out, path)
        if path == "rows":
            return self._prefill_rowwise(q, k_cache, v_cache, plan, out)
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

    def _prefill_tiles(self, q, k_cache, v_cache, plan: AttentionPlan, out, path: str) -> None:
        """Prefill rows through engine/layers/cpu_prefill_attention.py's tile or brgemm
        kernel (their K/V are in the cache already): tiles of rows of one sequence share
        every K and V load."""
        meta = plan.meta
        first, tok0 = meta.num_decodes, meta.num_decode_tokens
        if plan.prefill_tiles is None:       # once per forward, not once per layer
            seqs = range(first, first + meta.num_prefills)
            starts = [0]
            for i in seqs:
                starts.append(starts[-1] + meta.query_lens_host[i])
            plan.prefill_tiles = (
                meta.block_tables[first:first + meta.num_prefills].contiguous(),
                torch.tensor(starts, dtype=torch.long),
                torch.tensor([meta.context_lens_host[i] for i in seqs], dtype=torch.int32))
        tables, starts, ctx = plan.prefill_tiles
        n = int(starts[-1])
        kernel = (cpu_prefill_attention.prefill_attention if path == "tiles"
                  else cpu_prefill_attention.prefill_attention_brgemm)
        out[tok0:tok0 + n] = kernel(q[tok0:tok0 + n], k_cache, v_cache, tables, starts, ctx,
                                    self.scale)

    def _prefill_rowwise(self, q, k_cache, v_cache, plan: AttentionPlan, out) -> None:
        """Prefill rows through the paged kernel: each new token is a decode row of KV
        length position+1 (its K/V are in the cache already), so its attention is computed
        exactly as it would be in any other chunking, batch or decode step (SDPA's
        blocking depends on the query and KV lengths of the call, which vary with those:
        batch-invariant mode needs this). In bf16 with the kernel's AVX512-BF16 path it
        is also ~3x faster than SDPA."""
        meta = plan.meta
        first, tok0 = meta.num_decodes, meta.num_decode_tokens
        seqs = range(first, first + meta.num_prefills)
        if plan.prefill_rows is None:       # once per forward, not once per layer
            counts = [meta.query_lens_host[i] for i in seqs]
            tables = meta.block_tables[first:first + meta.num_prefills].repeat_interleave(
                torch.tensor(counts, device=meta.block_tables.device), dim=0).contiguous()
            kv_lens = torch.tensor([c + j + 1 for i in seqs
                                    for c in (meta.context_lens_host[i],)
                                    for j in range(meta.query_lens_host[i])],
                                   dtype=torch.int32, device=q.device)
            plan.prefill_rows = tables, kv_lens
        tables, kv_lens = plan.prefill_rows
        n = kv_lens.shape[0]
        out[tok0:tok0 + n] = cpu_paged_attention.paged_decode_attention(
            q[tok0:tok0 + n], k_cache, v_cache, tables, kv_lens, 1, self.scale,
            self.decode_path)
