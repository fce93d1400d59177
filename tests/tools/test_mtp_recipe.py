"""The MTP head's rebuild chain (tools/mtp_recipe.py): every stage is a valid train_mtp
command, each continues the head the stage before wrote, features are cached apart per
aux-layer setting, every corpus part is trained on, and the last stage writes --out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools.mtp_corpus import SELF_PARTS
from tools.mtp_recipe import STAGES, commands
from tools.train_mtp import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _parsed(cmd: list[str]):
    assert cmd[1].endswith("tools/train_mtp.py")
    return build_parser().parse_args(cmd[2:])


def test_stages_chain_through_init_and_end_at_out(tmp_path):
    out = tmp_path / "head.safetensors"
    cmds = commands("/models/m", tmp_path, out, 2)
    assert len(cmds) == len(STAGES)
    parsed = [_parsed(c) for c in cmds]
    assert parsed[0].init is None
    for before, after in zip(parsed, parsed[1:], strict=False):
        assert after.init == before.out
    assert parsed[-1].out == str(out)
    assert len({p.out for p in parsed}) == len(parsed)
    covered = {k for p in parsed for k in p.parts}
    assert covered == set(range(1, max(SELF_PARTS) + 1))    # every corpus part, in order


def test_feature_caches_are_kept_apart_per_aux_setting(tmp_path):
    parsed = [_parsed(c) for c in commands("/m", tmp_path, tmp_path / "o", 2)]
    by_cache = {}
    for p in parsed:
        by_cache.setdefault(p.cache, set()).add(p.aux_layers)
        assert p.corpus_cache == str(tmp_path / "corpus.pt")
    assert all(len(aux) == 1 for aux in by_cache.values())
    assert len(by_cache) == 2


def test_print_lists_every_stage_and_runs_nothing(tmp_path):
    work = tmp_path / "work"
    got = subprocess.run([sys.executable, "-m", "tools.mtp_recipe", "--workdir", str(work),
                          "--print", "--from-stage", "3"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    assert got.stdout.count("# stage ") == len(STAGES) - 2
    assert f"# stage 3/{len(STAGES)}: {STAGES[2][0]}" in got.stdout
    assert not work.exists()
    bad = subprocess.run([sys.executable, "-m", "tools.mtp_recipe", "--workdir", str(work),
                          "--from-stage", "0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--from-stage" in bad.stderr
