"""The compatibility fingerprint two PD nodes compare before any KV byte moves.

Equal fingerprints mean the prefill node's KV bytes can be written verbatim into the
decode node's blocks: same model weights' architecture/config, same KV dtype, block size,
cache layout and speculative (MTP) setup.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

# Version the byte layout of a pushed block (the wire layout of engine/kv_cache.py's
# gather_blocks / scatter_blocks, not the cache's own): bump when it changes.
KV_LAYOUT = "paged-kv/v1:[block,slot,kv_head,head_dim]"
# MLA (engine/models/mla.py): one latent row a token as K (kv_lora_rank + rope), no V
LATENT_KV_LAYOUT = "paged-latent/v1:[block,slot,1,kv_lora_rank+rope]"


@dataclass(frozen=True)
class Fingerprint:
    model: str
    dtype: str
    block_size: int
    kv_layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    mtp_enabled: bool = False
    mtp_num_speculative_tokens: int = 0
    mtp_num_draft_layers: int = 0

    def mismatches(self, other: Fingerprint) -> list[str]:
        """Human-readable differences, e.g. ["dtype: float32 here, bfloat16 there"]."""
        return [f"{f.name}: {getattr(self, f.name)!r} here, {getattr(other, f.name)!r} there"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def check_compatible(self, other: Fingerprint, peer: str = "peer") -> None:
        diff = self.mismatches(other)
        if diff:
            raise FingerprintMismatch(f"KV fingerprint mismatch with {peer}: " + "; ".join(diff))

    def as_dict(self) -> dict:
        return asdict(self)


class FingerprintMismatch(ValueError):
    pass


def model_identity(model_dir: str | Path, architecture: str) -> str:
    """architecture + a hash of config.json's content (not the path: two hosts may keep
    the same model in different folders)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    canon = json.dumps(cfg, sort_keys=True).encode()
    return f"{architecture}:{hashlib.sha256(canon).hexdigest()[:16]}"


def engine_fingerprint(engine) -> Fingerprint:
    """The fingerprint of an engine.engine_core.LLMEngine."""
    mc = engine.model_config
    return Fingerprint(model=model_identity(engine.config.model, mc.architecture),
                       dtype=str(engine.dtype).removeprefix("torch."),
                       block_size=engine.config.block_size,
                       kv_layout=LATENT_KV_LAYOUT if mc.kv_layout[2] == 0 else KV_LAYOUT,
                       num_layers=mc.num_hidden_layers, num_kv_heads=mc.kv_layout[0],
                       head_dim=mc.kv_layout[1],
                       mtp_enabled=engine.config.speculative_method == "mtp",
                       mtp_num_speculative_tokens=(engine.config.num_speculative_tokens
                                                   if engine.config.speculative_method else 0),
                       mtp_num_draft_layers=1 if engine.config.speculative_method else 0)
