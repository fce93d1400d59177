"""The decoder-only transformer shared by Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3
(a pure model; DeepSeek-V3's attention is MLA, engine/models/mla.py).

The architectures differ only in flags read from ModelConfig at construction: q/k/v
bias (Qwen2), q/k RMSNorm over head_dim (Qwen3), tied embeddings. The CPU kernels the
layers use are a KernelOptions value passed at construction too (engine/layers/
kernel_options.py). The forward takes everything it needs as arguments (no globals):
token ids, positions, the KV cache and the attention metadata, which the attention
backend prepares once into the plan every layer shares; it returns final-norm hidden
states, and `logits` computes the LM head on the selected rows only. An MTP head that
also reads mid-layer features (EAGLE-3 style) has the target return, after the final
hidden state on each row, the residual streams after the layers in `aux_layers`
(`set_aux_layers`, called before any executor is built: graph buffers take the width).

q/k/v and gate/up are fused into one matmul each at load time (engine/models/loader.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_input import AttentionMetadata
from engine.kv_cache import KVCache
from engine.layers import cpu_bf16_gemm, cpu_decode_layers
from engine.layers.attention import get_attention_backend
from engine.layers.cpu_paged_attention import DECODE_PATHS
from engine.layers.kernel_options import DEFAULT_KERNELS, KernelOptions
from engine.layers.linear import FUSED_SILU_MUL_ROWS, Linear, silu_mul_packed
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.layers.sdpa_attention import AttentionPlan, SdpaAttention
from engine.models import moe
from engine.models.mla import MlaAttention
from engine.models.mla_layout import is_mla
from engine.models.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend,
                 kernels: KernelOptions = DEFAULT_KERNELS):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary
        self.backend = backend

    def forward(self, x, positions, k_cache, v_cache, plan):
        """`plan`: the backend's prepared plan of this forward (or bare metadata)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = self.rotary(positions, q, k)
        else:
            q, k = self.rotary.rotate_qkv(qkv, positions, self.num_heads, self.num_kv_heads)
        o = self.backend(q, k, v, k_cache, v_cache, plan)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelOptions = DEFAULT_KERNELS):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        if kernels.cpu_epilogue_silu_mul:     # pack_linears also packs the two halves
            self.gate_up_proj.split_rows = self.inter
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate_up = self.gate_up_proj
        if gate_up.takes_bf16_silu_mul(x):      # engine/layers/cpu_bf16_gemm.py
            return self.down_proj(cpu_bf16_gemm.gemm_silu_mul(x, gate_up.gemm_silu_mul_packed,
                                                              gate_up.copy_kernel(x)))
        halves = gate_up.packed_halves
        if (halves is not None and x.dim() == 2 and x.shape[0] >= FUSED_SILU_MUL_ROWS
                and x.dtype == halves[0].dtype and not torch.is_grad_enabled()):
            return self.down_proj(silu_mul_packed(x, *halves))
        gate, up = gate_up(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend,
                 kernels: KernelOptions = DEFAULT_KERNELS, index: int = 0):
        """index: the layer's place in the stack (an MoE config says which are sparse)."""
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, kernels)
        self.self_attn = (MlaAttention(cfg, rotary, kernels) if is_mla(cfg.architecture)
                          else Attention(cfg, rotary, backend, kernels))
        self.post_attention_layernorm = RMSNorm(h, eps, kernels)
        self.mlp = moe.sparse_block(cfg) if moe.is_sparse_layer(cfg, index) \
            else MLP(cfg, kernels)

    def forward(self, x, residual, positions, k_cache, v_cache, plan):
        """Returns (MLP output, residual stream before it); the caller adds them, in the
        next layer's input norm or the final one, so each residual add fuses with the
        norm that follows it. residual None: x is the embedding (layer 0)."""
        h, residual = self.input_layernorm.add(x, residual)
        a = self.self_attn(h, positions, k_cache, v_cache, plan)
        h, residual = self.post_attention_layernorm.add(a, residual)
        return self.mlp(h), residual


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_backend: str = "sdpa",
                 kernels: KernelOptions = DEFAULT_KERNELS):
        super().__init__()
        self.config = cfg
        self.kernels = kernels      # kept for modules built on this one (the MTP draft)
        backend = get_attention_backend(attention_backend, cfg.head_dim ** -0.5, kernels)
        self.attention = backend    # one backend object shared by the layers
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling, kernels)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.architecture in moe.MOE_ARCHITECTURES:
            moe.check_config(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, backend, kernels, index=i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # register the shared rotary tables once, so .to(device) moves them
        self.rotary = rotary
        self.aux_layers: tuple[int, ...] = ()
        # decode-only forwards in one C++ call (engine/layers/cpu_decode_layers.py): set up
        # at the first decode forward (the linears are packed after construction)
        # (it calls the fused ops and the paged kernel: never built when those are off)
        self._decode_layers: DecodeLayers | None | bool = (
            not is_mla(cfg.architecture)
            and kernels.cpu_decode_layers and kernels.cpu_fused_ops
            and kernels.cpu_attention_kernel and kernels.cpu_packed_linear
            and cpu_decode_layers.available())

    def set_aux_layers(self, layers: tuple[int, ...] | list[int]) -> None:
        """Also return the residual stream after each of these layers (ascending), after
        the final hidden state on each row: rows of `output_width` values."""
        layers = tuple(int(i) for i in layers)
        n = self.config.num_hidden_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < n for i in layers):
            raise ValueError(f"aux layers {list(layers)} must be ascending, distinct "
                             f"and in 0..{n - 1} (the model has {n} layers)")
        self.aux_layers = layers

    @property
    def output_width(self) -> int:
        return self.config.hidden_size * (1 + len(self.aux_layers))

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        # once per forward, before the layers; inside a graph's captured callable this
        # reruns at every replay, so the plan always comes from the bound buffers
        plan = self.attention.prepare(meta, kv_cache.k[0])
        # likewise the rotary's cos/sin: gathered in this forward (in a graph's capture
        # too), never reused from an earlier one
        self.rotary.begin_forward()
        x, residual, aux = self.embed_tokens(token_ids), None, []
        runner = self.decode_layers()
        if runner is not None and runner.serves(x, plan):
            x, residual, *aux = runner.run(x, positions, kv_cache, plan, self.aux_layers)
        else:
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, positions, kv_cache.k[i], kv_cache.v[i], plan)
                if i in self.aux_layers:
                    aux.append(x + residual)
        hidden = self.norm.add(x, residual)[0]
        return torch.cat([hidden, *aux], dim=-1) if aux else hidden

    def decode_layers(self) -> DecodeLayers | None:
        """The one-call decode runner, or None when this model's layers cannot take it
        (decided at the first call, after the loader packed the linears)."""
        if self._decode_layers is True:
            self._decode_layers = DecodeLayers.for_model(self)
        return self._decode_layers or None

    def logits(self, hidden: torch.Tensor, selected_token_idxes: torch.Tensor,
               float32: bool = True) -> torch.Tensor:
        """LM head on the rows that will be sampled only (docs/ARCHITECTURE.md, "The
        execution trunk", step 5), in float32 unless `float32=False`: then in the model's
        dtype, for a caller that widens only when it needs to (the Sampler: a greedy batch's
        argmax reads bf16 rows as they are, and the [64, 49152] float32 copy, fresh pages
        each step, took 1.1-2.9 ms of a 40-70 ms batch-64 decode step)."""
        final = hidden[:, :self.config.hidden_size]     # the whole row without aux layers
        logits = self.lm_head(final.index_select(0, selected_token_idxes))
        return logits.float() if float32 else logits


def copies(layer) -> list[tuple]:
    """A decoder layer's streaming copies and their Linears: qkv, o, gate/up, down."""
    a, mlp = layer.self_attn, layer.mlp
    return [(a.qkv_proj.gemm_packed, a.qkv_proj), (a.o_proj.gemm_packed, a.o_proj),
            (mlp.gate_up_proj.gemm_silu_mul_packed, mlp.gate_up_proj),
            (mlp.down_proj.gemm_packed, mlp.down_proj)]


class DecodeLayers:
    """A DecoderForCausalLM's layers as engine/layers/cpu_decode_layers.py takes them: its
    weights gathered once, and the check of which forwards it serves."""

    def __init__(self, model: DecoderForCausalLM):
        cfg, attn = model.config, model.layers[0].self_attn
        empty = torch.empty(0, dtype=attn.qkv_proj.packed.dtype)
        self.weights = []
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            halves = mlp.gate_up_proj.packed_halves or (empty, empty)
            self.weights += [layer.input_layernorm.weight, a.qkv_proj.packed,
                             empty if a.qkv_proj.bias is None else a.qkv_proj.bias,
                             a.o_proj.packed, layer.post_attention_layernorm.weight, *halves,
                             mlp.gate_up_proj.packed, mlp.down_proj.packed,
                             # the streaming copies where the measured choice took them
                             # for decode-sized calls (engine/layers/linear_choice.py)
                             *(m if m is not None and lin.gemm_small else empty
                               for m, lin in copies(layer))]
        # per linear (qkv, o, gate/up, down): 0 oneDNN, 1 the streaming copy's VDPBF16PS
        # kernel, 2 its brgemm kernel (all layers share each one's measured choice)
        first = copies(model.layers[0])
        codes = [0 if m is None or not lin.gemm_small
                 else 1 + cpu_bf16_gemm.KERNELS.index(lin.gemm_small) for m, lin in first]
        self.rotary = model.rotary
        self.dims = [attn.num_heads, attn.num_kv_heads, attn.head_dim, cfg.intermediate_size,
                     FUSED_SILU_MUL_ROWS, *codes]
        self.eps, self.scale = cfg.rms_norm_eps, model.attention.scale
        # its decode_path is read at each call: it is chosen after the model is built
        self.attention = model.attention

    @classmethod
    def for_model(cls, model: DecoderForCausalLM) -> DecodeLayers | None:
        """None unless every layer runs the kernels the C++ call makes: packed bf16
        linears (no o/MLP bias), fused norms and rope, no q/k norm, the paged kernel."""
        backend = model.attention
        if (model.config.qk_norm or not isinstance(backend, SdpaAttention)
                or not (backend.use_cpu_kernel and backend.fused_write and model.rotary.fused)):
            return None
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, MLP):        # an MoE block: the Python layers run it
                return None
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (any(m.packed is None or m.packed.dtype != torch.bfloat16 for m in linears)
                    or any(m.bias is not None for m in linears[1:])
                    or not (layer.input_layernorm.fused_add
                            and layer.post_attention_layernorm.fused_add)):
                return None
        return cls(model)

    def serves(self, x: torch.Tensor, plan) -> bool:
        """A decode-only forward (plain or verify rows, padding included) in bf16 on CPU,
        its attention on the paged kernel, without autograd."""
        return (isinstance(plan, AttentionPlan) and plan.kv_lens is not None
                and not plan.meta.num_prefills and x.shape[0] == plan.num_dec * plan.rows
                and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and not torch.is_grad_enabled())

    def run(self, x, positions, kv_cache: KVCache, plan: AttentionPlan,
            aux_layers: tuple[int, ...]) -> list[torch.Tensor]:
        """[x, residual, the stream after each aux layer...], as the layers' loop."""
        meta = plan.meta
        return cpu_decode_layers.decode_layers(
            x, self.weights, kv_cache.k, kv_cache.v, positions, self.rotary.cos,
            self.rotary.sin_signed, meta.slot_mapping, meta.block_tables, plan.kv_lens,
            [plan.rows, *self.dims, DECODE_PATHS.index(self.attention.decode_path)],
            self.eps, self.scale, aux_layers)
