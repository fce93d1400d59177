"""Random MTP draft weights for the tiny test models, in the layouts the loader reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.loader import load_model
from engine.models.mtp import AUX_LAYERS_KEY, MTPModule

_MIMO = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
         "shared_head.norm": "final_layernorm"}


def random_mtp_tensors(folder: Path, prefix: str, seed: int = 1,
                       aux_layers: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Random head weights; with `aux_layers`, a head that also reads those target
    layers' residual streams (its aux projection and layer ids)."""
    model, cfg = load_model(folder, torch.float32, torch.device("cpu"))
    torch.manual_seed(seed)
    mtp = MTPModule(cfg, model.embed_tokens, model.lm_head, aux_layers=aux_layers)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    out = mtp.hf_state_dict(prefix)
    if aux_layers:
        out[prefix + AUX_LAYERS_KEY] = torch.tensor(aux_layers, dtype=torch.int64)
    return out


def with_mtp(folder: Path, dest: Path, layout: str = "deepseek", seed: int = 1,
             aux_layers: tuple[int, ...] = ()) -> Path:
    """Copy the tiny model `folder` to `dest` with random MTP weights added:
    layout "deepseek" (model.layers.{N}.*) or "mimo" (model.mtp_layers.0.*), and
    num_nextn_predict_layers: 1 in config.json; `aux_layers`: a head reading those
    target layers too."""
    if (dest / "config.json").is_file():
        return dest
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    tensors = random_mtp_tensors(folder, f"model.layers.{n}.", seed, aux_layers)
    if layout == "mimo":
        renamed = {}
        for k, v in tensors.items():
            rest = k[len(f"model.layers.{n}."):]
            for ds, mimo in _MIMO.items():
                if rest.startswith(ds + "."):
                    rest = mimo + rest[len(ds):]
            renamed["model.mtp_layers.0." + rest] = v
        tensors = renamed
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "mtp.safetensors"))
    cfg["num_nextn_predict_layers"] = 1
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


def draft_folder(folder: Path, dest: Path, seed: int = 1) -> Path:
    """A separate draft folder holding only the MTP weights (DeepSeek-V3 keys)."""
    if dest.is_dir():
        return dest
    dest.mkdir(parents=True)
    cfg = json.loads((folder / "config.json").read_text())
    tensors = random_mtp_tensors(folder, f"model.layers.{cfg['num_hidden_layers']}.", seed)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(dest / "model.safetensors"))
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest
