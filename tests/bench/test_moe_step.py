"""bench/moe_step.py runs end to end on tiny shapes and reports a row per row count (a smoke
of the script, not a timing: nothing here asserts a speed)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reports_each_row_count():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_step.py"), "--experts",
                          "4", "--top-k", "2", "--hidden", "32", "--inter", "16", "--rows",
                          "1,5", "--dtype", "float32"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "5"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and 1 <= int(r[4]) <= 4 for r in rows)
    assert out.startswith("CPU: ")
