"""Random MTP draft weights for the tiny test models, in the layouts the loader reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.loader import load_model
from engine.models.mtp import MTPModule

_MIMO = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
         "shared_head.norm": "final_layernorm"}


def random_mtp_tensors(folder: Path, prefix: str, seed: int = 1) -> dict[str, torch.Tensor]:
    model, cfg = load_model(folder, torch.float32, torch.device("cpu"))
    torch.manual_seed(seed)
    mtp = MTPModule(cfg, model.embed_tokens, model.lm_head)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return mtp.hf_state_dict(prefix)


def with_mtp(folder: Path, dest: Path, layout: str = "deepseek", seed: int = 1) -> Path:
    """Copy the tiny model `folder` to `dest` with random MTP weights added:
    layout "deepseek" (model.layers.{N}.*) or "mimo" (model.mtp_layers.0.*), and
    num_nextn_predict_layers: 1 in config.json."""
    if (dest / "config.json").is_file():
        return dest
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    tensors = random_mtp_tensors(folder, f"model.layers.{n}.", seed)
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
