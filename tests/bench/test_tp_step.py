"""bench/tp_step.py end to end on a tiny model (a smoke: three runs reported, the TP = 2 one
through a second rank process; nothing here asserts a speed)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.tiny_models import make_tiny_model  # noqa: E402


def test_reports_tp1_and_tp2(tmp_path):
    folder = make_tiny_model("qwen2-gqa4", tmp_path)[0]
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tp_step.py"), "--model",
                          str(folder), "--dtype", "float32", "--requests", "2", "--prompt",
                          "8", "--output", "4"], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    rows = [line for line in out.splitlines() if "output tok/s" in line]
    assert [r.split("  ")[1].strip() for r in rows] == [
        "TP = 1, kernels on", "TP = 1, kernels off", "TP = 2"]
    assert all(float(r.split()[-3]) > 0 for r in rows)
