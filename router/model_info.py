"""What the router knows about the model it serves: its name, limits and tokenizer.

Read from the same HF folder the nodes load, so tokenization happens in the router (nodes
get token ids) and the chat template is the folder's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    name: str                 # the `model` clients pass (default: the folder's name)
    folder: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_folder(cls, folder: str | Path, name: str | None = None,
                    max_model_len: int | None = None) -> ModelInfo:
        folder = Path(folder).expanduser()
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"model folder {folder} has no config.json")
        cfg = json.loads(cfg_path.read_text())
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        limit = int(cfg.get("max_position_embeddings", 2048))
        if max_model_len is not None:
            if max_model_len < 2:
                raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
            limit = min(limit, max_model_len)
        return cls(name=name or folder.resolve().name, folder=str(folder),
                   vocab_size=int(cfg["vocab_size"]), max_model_len=limit,
                   eos_token_ids=eos_ids)


def load_tokenizer(info: ModelInfo) -> Tokenizer:
    return Tokenizer(info.folder)
