"""The MTP draft module (multi-token prediction, DeepSeek-V3 layout) and its loader.

One draft step, at position t, given the target's (or the previous draft step's) hidden
state h_t and the token x_{t+1}:

    x = eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))     (MiMo: cat(h, e))
    x = decoder_layer(x)                                     K/V at position t
    hidden = x                  -> fed back as h for the next draft step
    logits = lm_head(shared_head.norm(x))                    predicts x_{t+2}

The embedding and the LM head are the target's (shared, never copied); the decoder layer is
the one in engine/models/decoder.py, so the draft uses the same attention backend and the
same paged cache layout (a one-layer cache of its own), and the target's KernelOptions.

Weights are found in the target's folder when config.json has num_nextn_predict_layers >= 1,
under DeepSeek-V3 keys `model.layers.{num_hidden_layers}.{enorm,hnorm,eh_proj,
shared_head.norm,<decoder layer>}` or MiMo keys `model.mtp_layers.0.{token_layernorm,
hidden_layernorm,input_proj,final_layernorm,<decoder layer>}`, or in a separate draft folder
holding either layout.

A head may also read target features from inside the model (EAGLE-3 style): with
`aux_layers` (int64 ids under `{prefix}aux_layers`), the target returns the residual
streams after those layers too (DecoderForCausalLM.set_aux_layers) and the hidden state
step 1 drafts from is `draft_input`'s h_t + aux_proj(cat(rms(a_t^l) for l in aux_layers))
(`{prefix}aux_proj.weight`). Later steps feed back the draft's own hidden state.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from engine.layers import cpu_bf16_gemm, linear_choice
from engine.layers.attention import get_attention_backend
from engine.layers.kernel_options import DEFAULT_KERNELS, KernelOptions
from engine.layers.linear import Linear, can_pack, pack_linears
from engine.layers.norm import RMSNorm
from engine.models import fp8
from engine.models.decoder import DecoderLayer
from engine.models.loader import (
    checkpoint_tensors,
    copy_experts,
    copy_weight,
    safetensors_files,
)
from engine.models.model_config import ModelConfig

# our parameter prefix -> (DeepSeek-V3 name, MiMo name) inside the MTP layer's key prefix
_PARTS = {
    "enorm": ("enorm", "token_layernorm"),
    "hnorm": ("hnorm", "hidden_layernorm"),
    "eh_proj": ("eh_proj", "input_proj"),
    "shared_head_norm": ("shared_head.norm", "final_layernorm"),
    "aux_proj": ("aux_proj", "aux_proj"),       # pdserve's mid-layer features (optional)
}
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_MIMO_PREFIX = "model.mtp_layers.0."
DRAFT_VOCAB_KEY = "draft_vocab"     # optional int64 token ids, next to the MTP weights
AUX_LAYERS_KEY = "aux_layers"       # optional int64 target layer ids (mid-layer features)


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 attention_backend: str | object = "sdpa", hidden_first: bool = False,
                 kernels: KernelOptions = DEFAULT_KERNELS, aux_layers: tuple[int, ...] = ()):
        super().__init__()
        from engine.layers.rotary import RotaryEmbedding
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        # a backend object (tools/train_mtp.py's dense training attention) is used as is
        backend = (get_attention_backend(attention_backend, cfg.head_dim ** -0.5, kernels)
                   if isinstance(attention_backend, str) else attention_backend)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling, kernels)
        self.enorm = RMSNorm(h, eps, kernels)
        self.hnorm = RMSNorm(h, eps, kernels)
        self.eh_proj = Linear(2 * h, h, bias=False)
        # the layer after the target's last: an MoE model's sparse-layer rules apply to it
        # (DeepSeek-V3's MTP layer is MLA + DeepSeekMoE)
        self.layer = DecoderLayer(cfg, self.rotary, backend, kernels,
                                  index=cfg.num_hidden_layers)
        self.shared_head_norm = RMSNorm(h, eps, kernels)
        self.hidden_first = hidden_first          # MiMo concatenates (h, e)
        self.hidden_size, self.eps = h, eps
        self.aux_layers = tuple(aux_layers)
        # zero-initialised by tools/train_mtp.py, so a head without it is the start
        self.aux_proj = (Linear(len(aux_layers) * h, h, bias=False) if aux_layers else None)
        # Optional draft vocabulary (token ids the head may propose): logits over it only,
        # a fraction of the full LM head's cost. Lossless: the draft's distribution q is
        # then zero elsewhere, which rejection sampling handles like any other q.
        self.draft_vocab: torch.Tensor | None = None
        self._draft_head: torch.Tensor | None = None
        # Shared with the target: held in a tuple so they are not registered (and so not
        # duplicated in state_dict or moved/cast twice).
        self._shared = (embed_tokens, lm_head)

    def forward(self, token_ids: torch.Tensor, prev_hidden: torch.Tensor,
                positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta) -> torch.Tensor:
        self.rotary.begin_forward()     # cos/sin from this forward's positions only
        e = self.enorm(self._shared[0](token_ids))
        h = self.hnorm(prev_hidden.to(e.dtype))
        x = self.eh_proj(torch.cat((h, e) if self.hidden_first else (e, h), dim=-1))
        # one layer: the backend prepares `meta` in its call (no plan to share)
        out, residual = self.layer(x, None, positions, k_cache, v_cache, meta)
        return residual + out

    def draft_input(self, target_rows: torch.Tensor) -> torch.Tensor:
        """The hidden state draft step 1 starts from, for rows of the target's output:
        its final hidden state, plus with aux layers a projection of the RMS-normalised
        residual streams the target returned after it (DecoderForCausalLM.forward)."""
        h = self.hidden_size
        if self.aux_proj is None:
            return target_rows[:, :h]
        n, k = target_rows.shape[0], len(self.aux_layers)
        if target_rows.shape[1] != h * (1 + k):
            raise ValueError(f"target rows have width {target_rows.shape[1]}, expected "
                             f"{h * (1 + k)} (final hidden + aux layers {self.aux_layers})")
        # normed in float32, as in training (the residual streams reach the hundreds)
        aux = F.rms_norm(target_rows[:, h:].reshape(n, k, h).float(), (h,), eps=self.eps)
        w = self.aux_proj.weight
        return target_rows[:, :h] + self.aux_proj(aux.reshape(n, k * h).to(w.dtype)).to(
            target_rows.dtype)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        head = self._shared[1].weight
        self.draft_vocab = token_ids.to(head.device, torch.int64)
        self._draft_head = head.detach().index_select(0, self.draft_vocab)

    def logits(self, hidden: torch.Tensor, selected: torch.Tensor | None = None
               ) -> torch.Tensor:
        if selected is not None:
            hidden = hidden.index_select(0, selected)
        normed = self.shared_head_norm(hidden)
        if self._draft_head is None:
            return self._shared[1](normed).float()
        sub = (normed @ self._draft_head.t()).float()
        full = torch.full((sub.shape[0], self._shared[1].weight.shape[0]), float("-inf"),
                          device=sub.device)
        return full.index_copy_(1, self.draft_vocab, sub)

    def hf_state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """Our parameters under DeepSeek-V3 key names (q/k/v and gate/up split again)."""
        out = {}
        for name, p in self.state_dict().items():
            top = name.split(".", 1)[0]
            if top in _PARTS:
                out[prefix + _PARTS[top][0] + name[len(top):]] = p
                continue
            assert name.startswith("layer."), name
            rest = name[len("layer."):]
            module, leaf = rest.rsplit(".", 1)
            parts = _FUSED.get(module)
            if parts is None:
                out[prefix + rest] = p
                continue
            sizes = self._fused_sizes(module)
            for part, chunk in zip(parts, p.split(sizes, dim=0), strict=True):
                out[f"{prefix}{part}.{leaf}"] = chunk.contiguous()
        return out

    def _fused_sizes(self, module: str) -> list[int]:
        attn = self.layer.self_attn
        if module == "self_attn.qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = self.layer.mlp.inter
        return [inter, inter]


def num_mtp_layers(folder: str | Path) -> int:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return int(cfg.get("num_nextn_predict_layers") or 0)


def _find_prefix(keys: set[str], num_hidden_layers: int | None) -> tuple[str, int]:
    """(key prefix, layout index: 0 DeepSeek-V3, 1 MiMo) of the first MTP layer."""
    if num_hidden_layers is not None:
        ds = f"model.layers.{num_hidden_layers}."
        if ds + "eh_proj.weight" in keys:
            return ds, 0
    if _MIMO_PREFIX + "input_proj.weight" in keys:
        return _MIMO_PREFIX, 1
    found = sorted(k[: -len("eh_proj.weight")] for k in keys if k.endswith(".eh_proj.weight"))
    if found:
        return found[0], 0
    raise ValueError("no MTP weights found: expected DeepSeek-V3 keys "
                     "model.layers.{num_hidden_layers}.eh_proj.weight (and enorm, hnorm, "
                     "shared_head.norm, the decoder layer) or MiMo keys "
                     "model.mtp_layers.0.input_proj.weight")


def _open_head(target_folder: str | Path, num_hidden_layers: int,
               draft_folder: str | Path | None):
    """(folder, {key: safetensors handle}, key prefix, layout) of the MTP head."""
    if draft_folder is None:
        folder = Path(target_folder)
        if num_mtp_layers(folder) < 1:
            raise ValueError(f"model folder {folder} has no MTP layer (config.json "
                             "num_nextn_predict_layers is missing or 0); pass "
                             "speculative_model=<draft folder>")
        layer_index = num_hidden_layers
    else:
        folder = Path(draft_folder)
        layer_index = None
        if (folder / "config.json").is_file():
            draft_cfg = json.loads((folder / "config.json").read_text())
            layer_index = draft_cfg.get("num_hidden_layers")
    handles = {}
    for path in safetensors_files(folder):
        f = safe_open(str(path), framework="pt")
        for key in f.keys():
            handles[key] = f
    prefix, layout = _find_prefix(set(handles), layer_index)
    return folder, handles, prefix, layout


def head_aux_layers(target_folder: str | Path, num_hidden_layers: int,
                    draft_folder: str | Path | None = None) -> tuple[int, ...]:
    """The target layers whose residual streams the MTP head reads (empty: the final
    hidden state only). The target must return them (set_aux_layers) before its
    executor is built."""
    _, handles, prefix, _ = _open_head(target_folder, num_hidden_layers, draft_folder)
    return _read_aux_layers(handles, prefix)


def _read_aux_layers(handles: dict, prefix: str) -> tuple[int, ...]:
    key = prefix + AUX_LAYERS_KEY
    if key not in handles:
        return ()
    return tuple(int(i) for i in handles[key].get_tensor(key).tolist())


def load_mtp(target_folder: str | Path, target_model: nn.Module, dtype: torch.dtype,
             device: torch.device, attention_backend: str = "sdpa",
             draft_folder: str | Path | None = None) -> MTPModule:
    """The MTP module for `target_model`, from `draft_folder` or else the target's folder;
    it uses the target's kernel options (chosen when the target was loaded). A head with
    aux layers needs the target to return them already (head_aux_layers)."""
    cfg: ModelConfig = target_model.config
    folder, handles, prefix, layout = _open_head(target_folder, cfg.num_hidden_layers,
                                                 draft_folder)
    aux_layers = _read_aux_layers(handles, prefix)
    if aux_layers and tuple(getattr(target_model, "aux_layers", ())) != aux_layers:
        raise ValueError(f"the MTP head in {folder} reads target layers "
                         f"{list(aux_layers)}, but the target returns "
                         f"{list(getattr(target_model, 'aux_layers', ()))}")
    with torch.device(device):
        mtp = MTPModule(cfg, target_model.embed_tokens, target_model.lm_head,
                        attention_backend, hidden_first=layout == 1,
                        kernels=target_model.kernels, aux_layers=aux_layers)
    mtp.to(dtype=dtype)
    mtp.rotary.float()
    missing = []
    for name, param in checkpoint_tensors(mtp).items():
        top = name.split(".", 1)[0]
        if top in _PARTS:
            names = [prefix + _PARTS[top][layout] + name[len(top):]]
        else:
            module, leaf = name[len("layer."):].rsplit(".", 1)
            names = [f"{prefix}{p}.{leaf}" for p in _FUSED.get(module, (module,))]
        if ".mlp.experts." in name:           # merged or per-expert (engine/models/moe.py)
            missing.extend(copy_experts(param, names[0], handles, dtype,
                                        fp8.block_size(cfg.raw)))
            continue
        missing.extend(copy_weight(param, names, handles, dtype, "MTP weight",
                                   "the target's config", block=fp8.block_size(cfg.raw)))
    if missing:
        raise ValueError(f"{folder} is missing MTP weights: {', '.join(missing[:8])}")
    if prefix + DRAFT_VOCAB_KEY in handles:
        mtp.set_draft_vocab(handles[prefix + DRAFT_VOCAB_KEY].get_tensor(
            prefix + DRAFT_VOCAB_KEY))
    kernels = target_model.kernels
    if kernels.cpu_packed_linear and can_pack(dtype, device):
        # one layer: its dense weights are kept (hf_state_dict reads them); and
        # cpu_bf16_gemm's copies, as the target's layers have
        bf16_gemm = kernels.cpu_bf16_gemm and cpu_bf16_gemm.available()
        pack_linears(mtp, release=False, bf16_gemm=bf16_gemm)
        if bf16_gemm and not kernels.cpu_bf16_gemm_measure:   # forced: one kernel
            linear_choice.force(mtp, kernels.cpu_bf16_gemm_kernel)
        elif bf16_gemm:   # keep the copies where faster here
            linear_choice.choose(mtp)
    elif dtype == torch.float32 and torch.device(device).type == "cpu":
        linear_choice.choose_small_rows(mtp)
    return mtp.eval()

