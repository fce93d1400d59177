"""Soak: a supervised local cluster (etcd, 2 prefill + 2 decode nodes, the router: real
processes, as `pdserve up` runs them) under a steady mix of HTTP (whole and SSE) and gRPC
(unary and stream) greedy requests for `--minutes`, with faults drawn at random (seeded):
SIGTERM (drain) and SIGKILL of a prefill or decode node, SIGSTOP of a prefill node for a
few seconds, etcd stopped for 30 s. Reports failed requests (must be 0), texts that differ
from the undisturbed single-node run (must be 0), the RSS drift of every node and router
process from its warm-up to its end (within 20%; a restarted process starts a new
baseline) and the etcd database size (flat). Writes soak.json and soak.md to --out.

    python -m bench.soak --minutes 30 --seed 1              # `make soak`
    python -m bench.soak --minutes 2 --model smollm2        # the default model

Faults and watching: bench/soak_faults.py; the load: bench/soak_load.py; the summary:
bench/soak_report.py."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.soak_faults import KINDS, Faults, Watch  # noqa: E402
from bench.soak_load import Load, make_pool, references  # noqa: E402
from bench.soak_report import summarize, write_reports  # noqa: E402

TICK_S = 0.5
SAMPLE_EVERY_S = 5.0


@dataclass
class SoakOptions:
    minutes: float = 30.0
    seed: int = 1
    model: str = "tiny"             # "tiny" (a random qwen2, tests/tiny_models.py),
    #                                 "smollm2" (the default model) or an HF folder
    out: Path | None = None
    prefill: int = 2
    decode: int = 2
    concurrency: int = 6
    pool_size: int = 48
    kinds: tuple[str, ...] = KINDS
    schedule: list[str] | None = None       # these faults in order (then none), not drawn
    gap_s: tuple[float, float] = (20.0, 50.0)
    first_fault_s: float = 30.0
    etcd_down_s: float = 30.0
    warmup_s: float = 120.0
    rss_limit: float = 0.20
    node_env: dict[str, str] = field(default_factory=dict)   # e.g. MALLOC_ARENA_MAX


def model_setup(opts: SoakOptions, work: Path) -> tuple[Path, list[str], dict]:
    """(folder, node flags, the reference engine's settings): float32 everywhere, so the
    greedy texts are exact."""
    if opts.model == "tiny":
        from tests.tiny_models import make_tiny_model
        from tests.tiny_tokenizer import add_tiny_tokenizer
        folder, _ = make_tiny_model("qwen2-gqa4", work / "models")
        folder, block, blocks = add_tiny_tokenizer(folder), 4, 1024
    else:
        if opts.model == "smollm2":
            from launch.default_model import prepare_default_model
            # the tests' cache (tests/conftest.py), under the git-ignored venv
            folder = prepare_default_model(ROOT / ".venv" / "pdserve-cache", progress=False)
        else:
            folder = Path(opts.model)
        block, blocks = 16, 512
    flags = ["--dtype", "float32", "--block-size", str(block), "--num-gpu-blocks",
             str(blocks), "--load-interval", "0.2", "--drain-timeout", "30"]
    return folder, flags, dict(dtype="float32", block_size=block, num_gpu_blocks=blocks)


def _control(cluster, faults: Faults, watch: Watch, stop: threading.Event,
             fatal: list) -> None:
    """Supervision, faults and sampling, one tick at a time, until `stop`."""
    next_sample = 0.0
    try:
        while not stop.is_set():
            now = time.monotonic()
            lost = cluster.supervise()
            if lost:
                fatal.extend(f"{c.name}: {c.log_tail(1500)}" for c in lost)
                return
            faults.step(now)
            if now >= next_sample:
                watch.sample(now)
                next_sample = now + SAMPLE_EVERY_S
            stop.wait(TICK_S)
    except Exception as exc:  # noqa: BLE001 - reported as the soak's failure
        fatal.append(f"control loop: {type(exc).__name__}: {exc}")
    finally:
        faults.close()


def run_soak(opts: SoakOptions) -> dict:
    from engine import LLM
    from launch.local_cluster import LocalCluster, LocalClusterConfig
    from router.model_info import ModelInfo

    out = Path(opts.out or tempfile.mkdtemp(prefix="pdserve-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    folder, flags, engine = model_setup(opts, out)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    pool = make_pool(opts.seed, opts.pool_size, vocab)
    llm = LLM(str(folder), **engine)
    refs = references(llm, pool)
    del llm
    gc.collect()

    # a fresh run folder: a kept one would hand the new cluster the last run's certificates
    shutil.rmtree(out / "run", ignore_errors=True)
    cluster = LocalCluster(LocalClusterConfig(
        model=str(folder), num_prefill=opts.prefill, num_decode=opts.decode, http_port=0,
        grpc_port=0, cluster="soak", node_args=flags, lease_ttl=2, run_dir=out / "run"))
    cluster.env.update(opts.node_env)
    cluster.notify = lambda m: print(f"[soak] {m}", flush=True)
    cluster.start(timeout=300)
    t0 = time.monotonic()
    faults = Faults(cluster, t0, opts.seed, tuple(opts.kinds), opts.schedule, opts.gap_s,
                    opts.first_fault_s, etcd_down_s=opts.etcd_down_s)
    watch = Watch(cluster, t0)
    load = Load(cluster.http_url, cluster.grpc_address, ModelInfo.from_folder(folder).name,
                pool, refs, opts.concurrency, opts.seed)
    fatal: list[str] = []
    stop_control = threading.Event()
    control = threading.Thread(target=_control, args=(cluster, faults, watch, stop_control,
                                                      fatal), name="soak-control")
    try:
        control.start()

        async def drive():
            stop_load = asyncio.Event()

            async def deadline():
                # the load runs until the end and every scheduled fault has run, and
                # until the last fault has recovered (nothing new begins after the end)
                end = t0 + opts.minutes * 60
                running = lambda: not fatal and control.is_alive()   # noqa: E731
                while running() and (time.monotonic() < end or faults.pending):
                    await asyncio.sleep(TICK_S)
                busy = faults.finish()
                while running() and busy:
                    await asyncio.sleep(TICK_S)
                    busy = faults.busy
                stop_load.set()
            await asyncio.gather(load.run(stop_load), deadline())
        asyncio.run(drive())
        watch.sample(time.monotonic())
    finally:
        stop_control.set()
        control.join(60)
        metrics = _router_metrics(cluster.http_url)
        restarts = list(cluster.supervisor.restart_times) if cluster.supervisor else []
        cluster.stop()
    report = summarize(opts, load.results, faults.records, watch, metrics, restarts, fatal,
                       time.monotonic() - t0)
    report["out"] = str(out)
    write_reports(report, out)
    return report


def _router_metrics(http_url: str) -> str:
    import urllib.request
    try:
        with urllib.request.urlopen(f"{http_url}/metrics", timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default="tiny",
                   help="tiny (random qwen2, the default), smollm2, or an HF model folder")
    p.add_argument("--out", type=Path, default=None, help="folder for soak.json / soak.md "
                   "and the cluster's logs (default: a new temporary folder)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--faults", default=",".join(KINDS),
                   help=f"comma-separated kinds to draw from (of {', '.join(KINDS)}; "
                        f"empty: none)")
    p.add_argument("--gap", type=float, nargs=2, default=(20.0, 50.0), metavar=("MIN", "MAX"),
                   help="seconds between a recovery and the next fault")
    p.add_argument("--warmup", type=float, default=120.0,
                   help="seconds after a process appears before its RSS baseline")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.faults.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown fault kind(s): {', '.join(sorted(unknown))}")
    report = run_soak(SoakOptions(minutes=args.minutes, seed=args.seed, model=args.model,
                                  out=args.out, concurrency=args.concurrency, kinds=kinds,
                                  gap_s=tuple(args.gap), warmup_s=args.warmup))
    print((Path(report["out"]) / "soak.md").read_text())
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
