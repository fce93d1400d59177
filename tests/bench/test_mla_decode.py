"""bench/mla_decode.py end to end on short sequences (a smoke of the script, which checks
that the kernel and the einsums agree on every shape; nothing here asserts a speed)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reports_every_shape():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "mla_decode.py"), "--quick",
                          "--dtype", "float32", "--reps", "1"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    rows = [line.rsplit(None, 3) for line in out.splitlines()[2:] if line.strip()]
    assert [r[0].strip() for r in rows] == ["8 x 1024", "32 x 256", "1 x 4096, 128 heads",
                                            "ragged 64-4096"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
