"""bench/latent_push_bytes.py end to end on a short prompt: the bytes a push hands over per
token are the latent rows for MLA (layers x (kv_lora_rank + rope) values) and K and V of
every head for its MHA twin."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.latent_push_bytes import MLA, SIZES  # noqa: E402


def test_reports_the_latent_and_the_mha_bytes_per_token():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "latent_push_bytes.py"),
                          "--tokens", "20", "--dtype", "float32"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    mla = float(re.search(r"MLA latent push\s+(\d+)", out).group(1))
    mha = float(re.search(r"MHA twin push\s+(\d+)", out).group(1))
    layers, heads = SIZES["num_hidden_layers"], SIZES["num_attention_heads"]
    assert mla == layers * (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]) * 4
    assert mha == layers * 2 * heads * (MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]) * 4
    assert "DeepSeek-V3's sizes" in out
