"""The shipped MTP head of the default model, rebuilt from nothing: one command chain.

    python -m tools.mtp_recipe --workdir /tmp/mtp-rebuild [--print] [--from-stage N]

runs tools/train_mtp.py once per stage, each stage continuing the head the one before wrote
(--init), with one corpus cache and one feature cache per aux-layer setting in --workdir,
so a stage only generates the corpus parts and features that are new to it. The last
stage writes --out (default: the head the package ships). --print only prints the
commands; --from-stage resumes after an interrupted run (the earlier heads must be in
--workdir).

The stages are the ones the shipped head went through, in order (costs on 2 CPU threads
with nothing else running; docs/perf/HISTORY.md has each stage's measurements):

1. chat parts 1-3, from the target's last layer, 5 epochs (~55 min with the corpus);
2. chat part 1 and raw part 4, one epoch, then one more at 1e-3 (~30 min);
3. parts 1, 4, 5, two epochs at 1e-3 (~35 min);
4. a third unrolled draft step, weight 0.3 then 0.6 (~12 min each);
5. the EAGLE-3-style inputs from layers 3 and 15, two epochs at 1e-3 (~50 min);
6. parts 1-5 with the teacher's distribution sharpened (temperature 0.25), two epochs
   (~65 min);
7. parts 1-6, one epoch at 4e-4 (~35 min);
8. parts 7 and 8 (tools/mtp_broad.py: many styles at small counts, sampled answers), two
   epochs at 4e-4, then two more at 6e-4 (~12 min of corpus and features, 8-9 min a run);
9. part 9 beside them (tools/mtp_selfgen.py: requests and raw text the target samples
   itself), one epoch at 4e-4, then one at 6e-4 (~29 min of prompts, answers and
   features, ~13 min a run);
10. part 10 beside those (a second draw of self-written requests and raw text, its answers
    sampled at temperature 0.8, top-p 0.95), one epoch at 4e-4 (~30 min of prompts,
    answers and features on a quiet machine, ~30 min the run; ~14 GB of memory).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "launch" / "assets" / "smollm2_mtp.safetensors"
AUX = ["--aux-layers", "3,15"]
NO_AUX = ["--aux-layers", "none"]
SHARP = ["--teacher-temp", "0.25", "--step3-weight", "0.6"]

# (stage name, train_mtp arguments beyond --model/--out/--init/--threads/caches)
STAGES: list[tuple[str, list[str]]] = [
    ("1-chat", ["--parts", "1,2,3", "--epochs", "5", *NO_AUX]),
    ("2a-raw", ["--parts", "1,4", "--epochs", "1", *NO_AUX]),
    ("2b-raw", ["--parts", "1,4", "--epochs", "1", "--lr", "1e-3", *NO_AUX]),
    ("3-styles", ["--parts", "1,4,5", "--epochs", "2", "--lr", "1e-3", *NO_AUX]),
    ("4a-step3", ["--parts", "1,4,5", "--epochs", "1", "--lr", "5e-4", "--step3-weight", "0.3",
                  *NO_AUX]),
    ("4b-step3", ["--parts", "1,4,5", "--epochs", "1", "--lr", "5e-4", "--step3-weight", "0.6",
                  *NO_AUX]),
    ("5-aux", ["--parts", "1,4,5", "--epochs", "2", "--lr", "1e-3", "--step3-weight", "0.6",
               *AUX]),
    ("6-sharp", ["--parts", "1,2,3,4,5", "--epochs", "2", "--lr", "5e-4", *SHARP, *AUX]),
    ("7-part6", ["--parts", "1,2,3,4,5,6", "--epochs", "1", "--lr", "4e-4", *SHARP, *AUX]),
    ("8a-broad", ["--parts", "7,8", "--epochs", "2", "--lr", "4e-4", *SHARP, *AUX]),
    ("8b-broad", ["--parts", "7,8", "--epochs", "2", "--lr", "6e-4", *SHARP, *AUX]),
    ("9a-self", ["--parts", "7,8,9", "--epochs", "1", "--lr", "4e-4", *SHARP, *AUX]),
    ("9b-self", ["--parts", "7,8,9", "--epochs", "1", "--lr", "6e-4", *SHARP, *AUX]),
    ("10-self-sampled", ["--parts", "7,8,9,10", "--epochs", "1", "--lr", "4e-4", *SHARP, *AUX]),
]


def commands(model: str, workdir: Path, out: Path, threads: int) -> list[list[str]]:
    """One train_mtp command line per stage, chained through --init."""
    cmds, previous = [], None
    for i, (name, extra) in enumerate(STAGES):
        aux = extra[extra.index("--aux-layers") + 1]
        target = out if i == len(STAGES) - 1 else workdir / f"head-{name}.safetensors"
        cmd = [sys.executable, str(ROOT / "tools" / "train_mtp.py"), "--model", model,
               "--out", str(target), "--threads", str(threads),
               "--corpus-cache", str(workdir / "corpus.pt"),
               "--cache", str(workdir / f"feat-aux-{aux.replace(',', '-')}.pt"), *extra]
        if previous is not None:
            cmd += ["--init", str(previous)]
        cmds.append(cmd)
        previous = target
    return cmds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "pdserve" / "models"
                                           / "SmolLM2-135M-Instruct"))
    ap.add_argument("--workdir", required=True, help="caches and the intermediate heads")
    ap.add_argument("--out", default=str(SHIPPED), help="where the last stage writes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--from-stage", type=int, default=1, help="first stage to run (1-based)")
    ap.add_argument("--print", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args()
    if not 1 <= args.from_stage <= len(STAGES):
        ap.error(f"--from-stage must be 1-{len(STAGES)}, got {args.from_stage}")
    workdir = Path(args.workdir)
    cmds = commands(args.model, workdir, Path(args.out), args.threads)
    for n, cmd in enumerate(cmds[args.from_stage - 1:], start=args.from_stage):
        print(f"# stage {n}/{len(cmds)}: {STAGES[n - 1][0]}\n{shlex.join(cmd)}", flush=True)
        if not args.print:
            workdir.mkdir(parents=True, exist_ok=True)
            subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
