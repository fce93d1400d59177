"""The trained MTP draft head of the default model, shipped in the package.

`launch/assets/smollm2_mtp.safetensors` (bf16, DeepSeek-V3 keys
`model.layers.30.*`, made by tools/train_mtp.py) is copied into the prepared folder as
`mtp.safetensors`, and config.json gains `num_nextn_predict_layers: 1`. Then
`LLM(folder, speculative_method="mtp")` finds the head and `LLM(folder)` ignores it (the
plain loader skips layers past num_hidden_layers; HF transformers reads only
model.safetensors). A folder prepared before the head existed, or holding an older head,
is brought up to date in place; each file is replaced atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

ASSET = Path(__file__).resolve().parent / "assets" / "smollm2_mtp.safetensors"
MTP_FILE = "mtp.safetensors"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def install_mtp_head(folder: Path, asset: Path = ASSET) -> bool:
    """Make `folder` hold the shipped head; returns True when something changed."""
    if not asset.is_file():
        return False                    # a source tree without the trained head
    folder = Path(folder)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    dest = folder / MTP_FILE
    changed = False
    if not dest.is_file() or _digest(dest) != _digest(asset):
        tmp = folder / f".{MTP_FILE}.tmp-{os.getpid()}"
        shutil.copyfile(asset, tmp)
        os.replace(tmp, dest)
        changed = True
    if cfg.get("num_nextn_predict_layers") != 1:
        cfg["num_nextn_predict_layers"] = 1
        tmp = folder / f".config.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, cfg_path)
        changed = True
    return changed
