"""Load an HF folder (config.json + single or sharded safetensors) into our model.

HF keeps q/k/v and gate/up as separate tensors; we fuse them here so the forward runs
one matmul for each group. Missing tensors are reported by their HF names.

The CPU kernels the model uses are chosen here, once: the caller's KernelOptions, or the
user's environment switches (`KernelOptions.from_env()`, read at this call, i.e. at
engine construction), narrowed to the device; the model gets the value at construction.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine import huge_pages
from engine.huge_pages import HugePageArena
from engine.huge_pages import advised as huge_pages_advised
from engine.layers import batch_invariant, cpu_bf16_gemm, linear_choice
from engine.layers.kernel_options import KernelOptions
from engine.layers.linear import can_pack, pack_linears
from engine.models import fp8, moe
from engine.models.model_config import ModelConfig
from engine.models.registry import model_class

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# our name (inside layers.i) -> the HF tensors concatenated along dim 0
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(f"model folder {folder} is missing weight shards: "
                                    f"{', '.join(missing)}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {folder} has no *.safetensors weights")
    return files


def _hf_names(our_name: str, cfg: ModelConfig) -> list[str]:
    """The HF tensor names that make up one of our parameters."""
    if our_name.startswith("layers."):
        _, idx, rest = our_name.split(".", 2)
        module, leaf = rest.rsplit(".", 1)
        parts = _FUSED.get(module, (module,))
        return [f"model.layers.{idx}.{p}.{leaf}" for p in parts]
    if our_name == "lm_head.weight":
        return ["lm_head.weight"]
    return [f"model.{our_name}"]


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device,
               attention_backend: str = "sdpa", kernels: KernelOptions | None = None,
               huge_pages: bool = False):
    """(model, config) from an HF folder. huge_pages: on a CPU, the weights a decode step
    streams moved onto huge pages after load (`streamed_to_huge_pages`)."""
    folder = Path(folder)
    kernels = (KernelOptions.from_env() if kernels is None else kernels).for_device(device)
    cfg = ModelConfig.from_folder(folder)
    cls = model_class(cfg)
    handles = {}
    for path in safetensors_files(folder):
        f = safe_open(str(path), framework="pt")
        for key in f.keys():
            m = _LAYER.match(key)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                continue    # e.g. MTP layers stored after the decoder layers
            handles[key] = f
    with torch.device(device):
        # the layers settle their kernels here (building or loading the CPU extensions
        # the options turn on, so the first request does not pay for it)
        model = cls(cfg, attention_backend=attention_backend, kernels=kernels)
    model.to(dtype=dtype)
    model.rotary.float()        # cos/sin tables stay float32, cast at use (as HF)
    missing = []
    block = fp8.block_size(cfg.raw)
    params = checkpoint_tensors(model)
    for name, param in params.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        names = _hf_names(name, cfg)
        if name == "lm_head.weight" and "lm_head.weight" not in handles:
            missing.append("lm_head.weight (and tie_word_embeddings is false)")
            continue
        if ".mlp.experts." in name:           # merged or per-expert (engine/models/moe.py)
            missing.extend(copy_experts(param, names[0], handles, dtype, block))
            continue
        missing.extend(copy_weight(param, names, handles, dtype, block=block))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more"
                                          if len(missing) > 8 else "")
        raise ValueError(f"model folder {folder} is missing weights: {shown}")
    moved = 0       # bytes already on huge pages
    if kernels.batch_invariant:
        batch_invariant.enable(model, kernels.batch_invariant_linear)
    elif kernels.cpu_packed_linear and can_pack(dtype, device):
        # the head keeps its dense weight: tied to the embedding, and the MTP draft head
        # reads it
        bf16_gemm = kernels.cpu_bf16_gemm and cpu_bf16_gemm.available()
        pack_linears(model, keep_dense=("lm_head",), bf16_gemm=bf16_gemm)
        if bf16_gemm and not kernels.cpu_bf16_gemm_measure:   # forced: one kernel
            linear_choice.force(model, kernels.cpu_bf16_gemm_kernel)
        elif bf16_gemm:   # keep the copies where faster here, timed where they will lie
            moved = streamed_to_huge_pages(model) if huge_pages else 0
            linear_choice.choose(model, "huge pages" if moved and huge_pages_advised() else "")
    elif dtype == torch.float32 and torch.device(device).type == "cpu":
        linear_choice.choose_small_rows(model)
    # (again where the choice dropped copies: a tighter arena)
    if huge_pages and torch.device(device).type == "cpu" and streamed_bytes(model) != moved:
        streamed_to_huge_pages(model)
    return model.eval(), cfg


STREAMED_COPIES = ("gemm_packed", "gemm_silu_mul_packed")   # Linear's streaming copies
LARGE_BYTES = 2 << 20       # a dense parameter this large is streamed by a decode step


@torch.no_grad()
def streamed_to_huge_pages(model: torch.nn.Module) -> int:
    """Move what a decode step streams into one mapping on huge pages (engine/
    huge_pages.py): the Linears' streaming copies and the dense parameters of 2 MB or more
    (the embedding and a tied head; every linear of a float32 model). oneDNN's prepacked
    weights are its own and stay. Each original is dropped as it is copied. Returns the
    bytes moved."""
    slots, params = _streamed(model)
    sizes = [_nbytes(getattr(m, a)) for m, a in slots] + [_nbytes(p) for p in params]
    if not sizes:
        return 0
    arena = HugePageArena(sum(HugePageArena.footprint(n) for n in sizes))
    for m, a in slots:
        setattr(m, a, arena.copy(getattr(m, a)))
    for p in params:
        p.data = arena.copy(p.data)
    log.info("%.0f MB of streamed weights on huge pages (OS mode: %s)", sum(sizes) / 1e6,
             huge_pages.mode())
    return sum(sizes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _streamed(model: torch.nn.Module) -> tuple[list[tuple], list[torch.nn.Parameter]]:
    """What `streamed_to_huge_pages` moves: (Linear, attribute) of each streaming copy, and
    the dense parameters of LARGE_BYTES or more."""
    slots = [(m, a) for m in model.modules() for a in STREAMED_COPIES
             if isinstance(getattr(m, a, None), torch.Tensor)]
    params = [p for p in model.parameters()
              if _nbytes(p) >= LARGE_BYTES and p.is_contiguous() and p.device.type == "cpu"]
    return slots, params


def streamed_bytes(model: torch.nn.Module) -> int:
    """The bytes `streamed_to_huge_pages` would move now."""
    slots, params = _streamed(model)
    return sum(_nbytes(getattr(m, a)) for m, a in slots) + sum(_nbytes(p) for p in params)


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint fills: the parameters, and DeepSeekMoE's router bias (a buffer,
    in HF's modules too, but stored in the checkpoint)."""
    params = dict(model.named_parameters(remove_duplicate=True))
    params.update((n, b) for n, b in model.named_buffers()
                  if n.endswith(".e_score_correction_bias"))
    return params


def copy_experts(param: torch.nn.Parameter, hf_name: str, handles: dict,
                 dtype: torch.dtype, block: tuple[int, int] = fp8.DEFAULT_BLOCK) -> list[str]:
    value = moe.expert_tensor(hf_name, handles, param.shape[0],
                              read=lambda n: fp8.read(handles, n, block))
    if value is None:
        return [f"{hf_name} (merged, or per expert as {hf_name.rsplit('.', 1)[0]}.<e>.*)"]
    _assign(param, value, dtype, f"weight {hf_name}", "the config")
    return []


def copy_weight(param: torch.nn.Parameter, names: list[str], handles: dict, dtype: torch.dtype,
                what: str = "weight", config: str = "the config",
                block: tuple[int, int] = fp8.DEFAULT_BLOCK) -> list[str]:
    """Copy the checkpoint tensors `names` (concatenated along dim 0 for a fused q/k/v or
    gate/up parameter) into `param`; returns the names the checkpoint lacks (nothing is
    copied then). A shape that disagrees with the config is an error naming the weight. FP8
    block-quantized tensors are dequantized with their scales (engine/models/fp8.py)."""
    absent = [n for n in names if n not in handles]
    if absent:
        return absent
    tensors = [fp8.read(handles, n, block) for n in names]
    value = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    _assign(param, value, dtype, f"{what} {'+'.join(names)}", config)
    return []


def _assign(param: torch.nn.Parameter, value: torch.Tensor, dtype: torch.dtype, label: str,
            config: str) -> None:
    """value into param, cast; a shape the config does not imply is an error naming it."""
    if value.shape != param.shape:
        raise ValueError(f"{label} has shape {tuple(value.shape)}, {config} implies "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value.to(dtype))
