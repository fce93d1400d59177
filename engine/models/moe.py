"""Mixture-of-experts MLP blocks (Qwen3-MoE; DeepSeekMoE's block), computed as HF does.

Qwen3-MoE: a router (a bias-free linear to `num_experts` logits) whose softmax is taken in
float32; each token's `num_experts_per_tok` largest probabilities pick its experts, and
with `norm_topk_prob` they are divided by their sum; the weights go back to the hidden
dtype. Each expert is a SwiGLU MLP of width `moe_intermediate_size`. Which layers are
sparse: every `decoder_sparse_step`-th (layer i when (i + 1) % step == 0), except those in
`mlp_only_layers`, which keep the dense MLP of `intermediate_size`.

The experts run as a grouped GEMM over tokens sorted by expert, not a loop over tokens:
for each expert that any token picked (in expert order) its rows are gathered, pass
through gate_up, silu(gate) * up and down in one matmul each, are scaled by their routing
weight and added into the output with index_add_. The order of those additions is HF's
(expert by expert, ascending), so a token's sum rounds as HF's does in float32.

Weights: the expert tensors are kept merged, [E, 2I, H] for gate/up and [E, H, I] for down
(transformers 5's layout, also a checkpoint key form); checkpoints with one tensor per
expert (`mlp.experts.{e}.gate_proj.weight`, ..., the form Qwen ships) are stacked at load
(`expert_tensor`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.model_config import ModelConfig

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")
DEEPSEEK = "DeepseekV3ForCausalLM"


def num_experts(raw: dict):
    """`num_experts` (Qwen's configs), `num_local_experts` (transformers 5 writes it) or
    `n_routed_experts` (DeepSeek)."""
    return raw.get("num_experts", raw.get("num_local_experts", raw.get("n_routed_experts")))


def is_sparse_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether decoder layer `layer` of this config has an MoE block (else a dense MLP).
    DeepSeek: the layers from `first_k_dense_replace` on, every `moe_layer_freq`-th."""
    raw = cfg.raw
    if cfg.architecture not in MOE_ARCHITECTURES or not num_experts(raw):
        return False
    if cfg.architecture == DEEPSEEK:
        freq = raw.get("moe_layer_freq", 1) or 1
        return layer >= (raw.get("first_k_dense_replace") or 0) and layer % freq == 0
    step = raw.get("decoder_sparse_step", 1) or 1
    return layer not in (raw.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def check_config(cfg: ModelConfig) -> None:
    """A clear error for an MoE config field this block does not implement."""
    raw = cfg.raw
    if cfg.hidden_act != "silu":
        raise ValueError(f"{cfg.architecture}: hidden_act {cfg.hidden_act!r} is not "
                         "supported (only silu)")
    fields = {"num_experts": num_experts(raw), "num_experts_per_tok":
              raw.get("num_experts_per_tok"), "moe_intermediate_size":
              raw.get("moe_intermediate_size")}
    for field, value in fields.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{cfg.architecture}: config field {field} must be a positive "
                             f"integer, got {value!r}")
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise ValueError(f"{cfg.architecture}: num_experts_per_tok "
                         f"{fields['num_experts_per_tok']} exceeds num_experts "
                         f"{fields['num_experts']}")


def sparse_block(cfg: ModelConfig) -> nn.Module:
    """The MoE block of a sparse layer of this architecture."""
    return DeepseekMoeBlock(cfg) if cfg.architecture == DEEPSEEK else SparseMoeBlock(cfg)


class SparseMoeBlock(nn.Module):
    """Router + experts of one sparse layer; parameter names mirror HF's
    (`gate.weight`, `experts.gate_up_proj`, `experts.down_proj`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw = cfg.raw
        h = cfg.hidden_size
        self.num_experts = num_experts(raw)
        self.top_k = raw["num_experts_per_tok"]
        self.norm_topk_prob = bool(raw.get("norm_topk_prob", False))
        self.inter = raw["moe_intermediate_size"]
        self.gate = RouterWeight(self.num_experts, h)
        self.experts = Experts(self.num_experts, h, self.inter)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k] in x's dtype), as HF's router."""
        # F.linear as HF (not engine/layers/linear.py's Linear, whose 2-4-row float32 path
        # and bf16 prepacking round differently): a routing pick must not flip on a bit
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return self.experts(x, ids, weights)


class RouterWeight(nn.Module):
    """A bare [out, in] weight used through F.linear as HF does (the router's
    `mlp.gate.weight`, a shared expert's projections), kept out of the loader's linear
    packing."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        flat = ids.reshape(-1)
        # the (token, slot) pairs sorted by expert: one contiguous run of rows per expert
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        return self.grouped(x, order // ids.shape[1], weights.reshape(-1)[order], counts)

    def grouped(self, x: torch.Tensor, tokens: torch.Tensor, slot_weights: torch.Tensor,
                counts: list[int]) -> torch.Tensor:
        """Sum over (token, slot) pairs sorted by expert, `counts[e]` of them for expert e:
        each expert's rows in one GEMM pair, weighted and added into their tokens' rows."""
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            gate, up = F.linear(x.index_select(0, rows),
                                self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            # (float32 DeepSeek weights: the product is float32, cast back as HF does)
            out.index_add_(0, rows, (y * slot_weights[start:start + n, None]).to(out.dtype))
            start += n
        return out


class DeepseekMoeBlock(nn.Module):
    """DeepSeekMoE (DeepSeek-V3's sparse layers), as HF's DeepseekV3MoE computes it: the
    router in float32 (the hidden state and weight cast up), sigmoid scores; for the choice
    only, `e_score_correction_bias` is added, experts are split into `n_group` groups scored
    by the sum of their two best, the `topk_group` best groups kept and the top-k taken among
    their experts; the weights are the plain scores of the chosen, divided by their sum (+
    1e-20) with `norm_topk_prob`, times `routed_scaling_factor`, kept in float32. The
    routed experts run as `Experts`; `n_shared_experts` more run on every token as one SwiGLU
    of width n_shared x moe_intermediate_size, added last."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw = cfg.raw
        h = cfg.hidden_size
        self.num_experts = raw["n_routed_experts"]
        self.top_k = raw["num_experts_per_tok"]
        self.n_group = raw.get("n_group", 1) or 1
        self.topk_group = raw.get("topk_group", 1) or 1
        self.norm_topk_prob = bool(raw.get("norm_topk_prob", True))
        self.scaling = float(raw.get("routed_scaling_factor", 1.0))
        inter = raw["moe_intermediate_size"]
        if self.num_experts % self.n_group:
            raise ValueError(f"{cfg.architecture}: n_routed_experts {self.num_experts} is "
                             f"not a multiple of n_group {self.n_group}")
        self.gate = RouterWeight(self.num_experts, h)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))
        self.experts = Experts(self.num_experts, h, inter)
        shared = raw.get("n_shared_experts") or 0
        self.shared_experts = SwiGlu(h, inter * shared) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], float32 weights [T, k]), as HF's router."""
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        choice = scores + self.gate.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        keep = keep.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1,
                                                                             self.num_experts)
        choice = choice.masked_fill(~keep.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class SwiGlu(nn.Module):
    """down(silu(gate(x)) * up(x)) through F.linear, HF's parameter names."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = RouterWeight(inter, hidden)    # a bare [out, in] weight each
        self.up_proj = RouterWeight(inter, hidden)
        self.down_proj = RouterWeight(hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate_proj.weight))
                        * F.linear(x, self.up_proj.weight), self.down_proj.weight)


def expert_tensor(our_name: str, handles: dict, num_experts: int,
                  read=None) -> torch.Tensor | None:
    """An experts parameter (`model.layers.{i}.mlp.experts.gate_up_proj` or `.down_proj`,
    HF names) from a checkpoint: the merged tensor if stored so, else stacked from the
    per-expert tensors (gate_proj and up_proj concatenated per expert); None when neither
    form is complete. read(name): how one checkpoint tensor is read (the loader's
    dequantizes FP8 block-quantized experts, as DeepSeek ships them)."""
    if read is None:
        def read(n: str) -> torch.Tensor:
            return handles[n].get_tensor(n)
    if our_name in handles:
        return read(our_name)
    prefix, leaf = our_name.rsplit(".", 1)
    parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    names = [[f"{prefix}.{e}.{p}.weight" for p in parts] for e in range(num_experts)]
    if any(n not in handles for per in names for n in per):
        return None
    return torch.stack([torch.cat([read(n) for n in per], dim=0) for per in names])
