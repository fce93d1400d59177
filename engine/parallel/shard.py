"""A loaded DecoderForCausalLM cut into one rank's tensor-parallel shard, in place.

Megatron's split, which needs one all-reduce per attention block and one per MLP:

- attention: the query heads are split evenly across ranks (column-parallel q/k/v: each
  rank keeps the rows of its heads in the fused qkv projection), and each rank keeps the
  KV heads its query heads read (an even split when the KV heads divide by the ranks; when
  there are fewer KV heads than ranks, ranks share a KV head, a copy each). o_proj is
  row-parallel: each rank multiplies its heads' columns, and an all-reduce sums the parts
  (its bias added after the sum, on every rank: every rank must hold the same hidden state).
- MLP: gate and up split by intermediate columns (column-parallel), down row-parallel with
  an all-reduce.
- MoE blocks (expert parallel over the same ranks): every rank routes every token (the
  router is small and whole everywhere), computes the tokens' slots that went to its own
  experts (an even split of them), and an all-reduce sums the experts' weighted outputs;
  shared experts run on rank 0 only. gloo has no all-to-all, so tokens are not sent to
  their experts' ranks: each rank reads all of them, which costs nothing extra here since
  every rank already holds every token after the attention's all-reduce.
- the embedding and the LM head split by vocabulary rows (a tied head shares the
  embedding's rows): a rank looks up the tokens in its rows, zeros for the others, and an
  all-reduce sums the lookups (exact: one non-zero term); each rank computes the logits of
  its rows and an all-gather makes the whole row (on every rank; rank 0 samples). A
  vocabulary that does not divide among the ranks stays whole on every rank. The norms
  stay whole: after each all-reduce every rank holds the full hidden state.

The cut is made on float weights before any CPU packing, with the C++ kernels off (a
rank's forward must run the Python layers, where the all-reduces sit). The all-reduce adds
partial sums in another order than one rank's matmul does: float32 logits then differ
within a tolerance (tests/engine/test_tensor_parallel.py says how much and why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.decoder import MLP, Attention, DecoderForCausalLM
from engine.models.mla import MlaAttention
from engine.models.mla_layout import is_mla
from engine.models.model_config import ModelConfig
from engine.models.moe import MOE_ARCHITECTURES, Experts, num_experts


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product (no bias), summed over the group,
    then the bias."""

    def __init__(self, inner: nn.Module, group, bias: torch.Tensor | None):
        super().__init__()
        self.inner = inner
        self.group = group
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(self.inner(x).contiguous())
        return out if self.bias is None else out + self.bias


def check_shardable(cfg: ModelConfig, world: int, expert_world: int | None = None) -> None:
    """A clear error for a model this split does not cover (before any rank starts).
    expert_world: the expert-parallel size (default: world)."""
    experts = num_experts(cfg.raw) if cfg.architecture in MOE_ARCHITECTURES else None
    if experts and (expert_world or world) > 1 and experts % world:
        raise ValueError(f"{cfg.architecture}: {experts} experts do not divide among "
                         f"tensor_parallel_size {world} ranks (expert parallel)")
    h, hk, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    problems = [f"{name} {n} is not divisible by tensor_parallel_size {world}"
                for name, n in (("num_attention_heads", h), ("intermediate_size", inter))
                if n % world]
    if not is_mla(cfg.architecture) and hk % world and world % hk:
        problems.append(f"num_key_value_heads {hk} and tensor_parallel_size {world} do not "
                        "divide one another")
    if problems:
        raise ValueError(f"{cfg.architecture}: " + "; ".join(problems))


def _rows(w: torch.Tensor | None, spans: list[tuple[int, int]]) -> torch.Tensor | None:
    if w is None:
        return None
    return torch.cat([w[a:b] for a, b in spans], dim=0).contiguous()


def shard_model(model: DecoderForCausalLM, rank: int, world: int, group,
                expert_parallel: bool = True) -> None:
    """expert_parallel: split MoE experts across the ranks (False: every rank keeps every
    expert and computes the whole block, as each holds the whole hidden state)."""
    cfg = model.config
    check_shardable(cfg, world, world if expert_parallel else 1)
    if not all(isinstance(x.self_attn, Attention | MlaAttention) for x in model.layers):
        raise ValueError(f"{cfg.architecture}: its attention does not shard")
    h, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    heads = range(rank * h // world, (rank + 1) * h // world)
    groups = h // hk
    kv_heads = sorted({q // groups for q in heads})
    inter = cfg.intermediate_size
    cols = (rank * inter // world, (rank + 1) * inter // world)
    with torch.no_grad():
        shard_vocab(model, rank, world, group)
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            if isinstance(a, MlaAttention):
                _shard_mla(a, heads, group)
            else:
                _shard_attention(a, heads, kv_heads, h, hk, d, group)
            if not isinstance(mlp, MLP):     # an MoE block: its experts split across ranks
                if expert_parallel:
                    layer.mlp = ExpertParallel(mlp, group, rank, world)
                continue
            _shard_mlp(mlp, cols, inter, group)


def _shard_attention(a: Attention, heads: range, kv_heads: list[int], h: int, hk: int,
                     d: int, group) -> None:
    """q/k/v rows of this rank's query heads and of the KV heads they read; o_proj
    row-parallel."""
    q0, k0 = 0, h * d
    v0 = k0 + hk * d
    spans = ([(q0 + heads[0] * d, q0 + (heads[-1] + 1) * d)]
             + [(k0 + k * d, k0 + (k + 1) * d) for k in kv_heads]
             + [(v0 + k * d, v0 + (k + 1) * d) for k in kv_heads])
    a.qkv_proj.weight = nn.Parameter(_rows(a.qkv_proj.weight, spans), requires_grad=False)
    if a.qkv_proj.bias is not None:
        a.qkv_proj.bias = nn.Parameter(_rows(a.qkv_proj.bias, spans), requires_grad=False)
    a.num_heads, a.num_kv_heads = len(heads), len(kv_heads)
    a.q_size, a.kv_size = len(heads) * d, len(kv_heads) * d
    a.o_proj = _row_parallel(a.o_proj, heads[0] * d, (heads[-1] + 1) * d, group)


def _row_parallel(linear: nn.Module, lo: int, hi: int, group) -> RowParallel:
    """Input columns [lo, hi) of `linear`, its bias kept for after the all-reduce."""
    bias = linear.bias.detach().clone() if linear.bias is not None else None
    linear.weight = nn.Parameter(linear.weight[:, lo:hi].contiguous(), requires_grad=False)
    linear.bias = None
    return RowParallel(linear, group, bias)


def _shard_mla(a: MlaAttention, heads: range, group) -> None:
    """MLA: the query and kv_b_proj rows of this rank's heads (the latent, kv_a_proj and
    its norm stay whole: every rank writes the same latent cache), o_proj row-parallel."""
    d = a.dims
    h0, h1 = heads[0], heads[-1] + 1
    q = a.q_proj if d.q_lora_rank is None else a.q_b_proj
    q.weight = nn.Parameter(q.weight[h0 * a.qk_dim:h1 * a.qk_dim].contiguous(),
                            requires_grad=False)
    kvb = a.kv_b_proj
    kvb.weight = nn.Parameter(kvb.weight[h0 * (d.nope + d.v):h1 * (d.nope + d.v)]
                              .contiguous(), requires_grad=False)
    a.num_heads = h1 - h0
    a.o_proj = _row_parallel(a.o_proj, h0 * d.v, h1 * d.v, group)


def _shard_mlp(mlp: MLP, cols: tuple[int, int], inter: int, group) -> None:
    """gate and up columns [cols); down row-parallel."""
    gu = mlp.gate_up_proj
    gate_up = [(cols[0], cols[1]), (inter + cols[0], inter + cols[1])]
    gu.weight = nn.Parameter(_rows(gu.weight, gate_up), requires_grad=False)
    if gu.bias is not None:
        gu.bias = nn.Parameter(_rows(gu.bias, gate_up), requires_grad=False)
    mlp.inter = cols[1] - cols[0]
    gu.split_rows = None
    mlp.down_proj = _row_parallel(mlp.down_proj, cols[0], cols[1], group)


class LocalExperts(nn.Module):
    """Experts [lo, hi) of an MoE block's Experts: the (token, slot) pairs routed to them,
    in the same per-expert grouped GEMM and order; pairs routed elsewhere add nothing."""

    def __init__(self, experts: Experts, lo: int, hi: int):
        super().__init__()
        self.lo, self.hi = lo, hi
        self.local = Experts(hi - lo, experts.down_proj.shape[1], experts.down_proj.shape[2])
        with torch.no_grad():
            self.local.gate_up_proj = nn.Parameter(
                experts.gate_up_proj[lo:hi].contiguous(), requires_grad=False)
            self.local.down_proj = nn.Parameter(experts.down_proj[lo:hi].contiguous(),
                                                requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        flat = ids.reshape(-1)
        mine = ((flat >= self.lo) & (flat < self.hi)).nonzero().squeeze(1)
        if mine.numel() == 0:
            return torch.zeros_like(x)
        local = flat[mine] - self.lo
        order = torch.argsort(local, stable=True)          # runs of rows per local expert
        tokens = (mine // ids.shape[1])[order]
        slot_weights = weights.reshape(-1)[mine][order]
        counts = torch.bincount(local, minlength=self.hi - self.lo).tolist()
        return self.local.grouped(x, tokens, slot_weights, counts)


class ExpertParallel(nn.Module):
    """An MoE block whose experts are split across the group: each rank's part, summed."""

    def __init__(self, block: nn.Module, group, rank: int, world: int):
        super().__init__()
        e = block.experts.gate_up_proj.shape[0]
        block.experts = LocalExperts(block.experts, rank * e // world, (rank + 1) * e // world)
        if rank != 0 and getattr(block, "shared_experts", None) is not None:
            block.shared_experts = None
        self.block, self.group = block, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.block(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the embedding on this rank: a token outside them looks up nothing
    (zeros), and the all-reduce of the ranks' lookups is the whole embedding (one non-zero
    term a row: exact)."""

    def __init__(self, embedding: nn.Embedding, group, lo: int, hi: int):
        super().__init__()
        self.lo, self.hi, self.group = lo, hi, group
        self.weight = nn.Parameter(embedding.weight[lo:hi].detach().clone(),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(mine, ids - self.lo, torch.zeros_like(ids))
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(rows.contiguous())


class VocabParallelHead(nn.Module):
    """The LM head's rows [lo, hi) on this rank: each rank's logits of its share of the
    vocabulary, gathered into the whole row (every rank computes it: the sampler runs on
    rank 0, the others discard theirs)."""

    def __init__(self, weight: torch.Tensor, group):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(
            weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.group.all_gather(F.linear(x, self.weight)), dim=-1)


def shard_vocab(model: DecoderForCausalLM, rank: int, world: int, group) -> bool:
    """The embedding and the LM head split by vocabulary rows (a tied head shares the
    embedding's slice); False (both left whole) when the vocabulary does not divide."""
    vocab = model.config.vocab_size
    if vocab % world or model.embed_tokens.weight.shape[0] != vocab:
        return False
    lo, hi = rank * vocab // world, (rank + 1) * vocab // world
    tied = model.lm_head.weight is model.embed_tokens.weight
    head = model.lm_head.weight
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, group, lo, hi)
    weight = model.embed_tokens.weight if tied else nn.Parameter(
        head[lo:hi].detach().clone(), requires_grad=False)
    model.lm_head = VocabParallelHead(weight, group)
    return True
