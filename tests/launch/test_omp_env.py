"""launch/omp_env.py: node processes take a short OpenMP spin unless the user chose one,
and only while libgomp has not loaded yet (it reads the variable at `import torch`)."""

import os
import subprocess
import sys
from pathlib import Path

import torch  # noqa: F401  (loaded here, as in any test process)

from launch.omp_env import NODE_SPINCOUNT, apply_node_spin_default

ROOT = Path(__file__).resolve().parents[2]


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_sets_spin_count_before_torch_loads_in_a_fresh_process():
    code = ("import os, sys; from launch.omp_env import apply_node_spin_default as a; "
            "print(a(), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == ["True", NODE_SPINCOUNT, "False"]


def test_node_entry_sets_it_before_importing_torch():
    # run_node's first step, then what it imports next: torch must not be in yet when the
    # variable is set, so libgomp (loaded with torch) sees it
    code = ("import os, sys; import launch.node_main as m, launch.omp_env as o; "
            "seen = []; orig = o.apply_node_spin_default; "
            "o.apply_node_spin_default = lambda: seen.append('torch' in sys.modules) or orig(); "
            "import cluster.node_server; "
            "m.metrics_address = lambda a: (_ for _ in ()).throw(SystemExit(0)); "
            "\ntry:\n    m.run_node('prefill', type('A', (), {'node_id': 'x'})())\n"
            "except SystemExit:\n    pass\n"
            "print(seen, os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[False]", NODE_SPINCOUNT]


def test_user_choice_is_kept():
    env = {"GOMP_SPINCOUNT": "123"}
    assert apply_node_spin_default(env) is False and env == {"GOMP_SPINCOUNT": "123"}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert apply_node_spin_default(env) is False and "GOMP_SPINCOUNT" not in env


def test_too_late_once_torch_is_loaded(caplog):
    env: dict = {}
    assert apply_node_spin_default(env) is False      # torch is imported in this process
    assert env == {} and "before the OpenMP spin default" in caplog.text
