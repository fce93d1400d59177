"""A prefill node's RSS over many requests (issue 18: it grew 60-80 KB per request).

Starts a local cluster (1 prefill + 1 decode node and a router, real processes and etcd),
sends `--requests` completions through the router (random token prompts of 8-200 tokens,
4 output tokens, `--concurrency` at a time) in waves of `--every`, and samples VmRSS of
the prefill and the decode node at rest after each wave (PDSERVE_HEAP_TRIM=0 in `--env`
turns the nodes' heap trimming off). Prints the series and the growth per request after
the warm-up, as JSON. `--env K=V` goes to the nodes (MALLOC_ARENA_MAX=2, ...); `--probe`
turns on bench/memprobe (malloc statistics, live objects by type, tracemalloc growth with
`--env PYTHONTRACEMALLOC=1`) in the nodes, written under the run folder's memprobe/.

    python -m bench.prefill_rss --model smollm2 --requests 1500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.soak import SoakOptions, model_setup  # noqa: E402
from bench.soak_faults import rss_kb  # noqa: E402

# The nodes trim after TRIM_IDLE_S idle (PDSERVE_HEAP_TRIM_IDLE_S, unless --env sets it; a
# node's default is 30 s), and the load pauses QUIET_S > that: a trimming node has trimmed.
TRIM_IDLE_S = 3.0
QUIET_S = 8.0


async def _drive(http_url: str, model: str, vocab: int, n: int, concurrency: int,
                 every: int, sample, seed: int) -> list[str]:
    """Waves of `every` requests, `concurrency` at a time; after each wave the load stops
    for `QUIET_S` and `sample` runs: RSS at rest (what was retained), not mid-burst."""
    from aiohttp import ClientSession

    rng = random.Random(seed)
    errors: list[str] = []

    async def one(http, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        try:
            async with http.post(f"{http_url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    errors.append(f"{resp.status}: {(await resp.text())[:200]}")
                await resp.read()
        except Exception as exc:  # noqa: BLE001 - counted
            errors.append(repr(exc)[:200])

    gate = asyncio.Semaphore(concurrency)

    async def gated(http, prompt):
        async with gate:
            await one(http, prompt)

    async with ClientSession() as http:
        for done in range(every, n + 1, every):
            wave = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 201))]
                    for _ in range(every)]
            await asyncio.gather(*[gated(http, p) for p in wave])
            await asyncio.sleep(QUIET_S)
            sample(done)
    return errors


def main(argv: list[str] | None = None) -> int:
    from launch.local_cluster import LocalCluster, LocalClusterConfig
    from router.model_info import ModelInfo

    p = argparse.ArgumentParser(prog="python -m bench.prefill_rss")
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or an HF folder")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--warmup", type=int, default=200, help="requests before the baseline")
    p.add_argument("--env", action="append", default=[], metavar="K=V")
    p.add_argument("--probe", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    folder, flags, _ = model_setup(SoakOptions(model=args.model), args.out)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    cluster = LocalCluster(LocalClusterConfig(
        model=str(folder), num_prefill=1, num_decode=1, http_port=0, grpc_port=0,
        cluster="rss", node_args=flags, run_dir=args.out / "run", restart_nodes=False))
    env = {"PDSERVE_HEAP_TRIM_IDLE_S": f"{TRIM_IDLE_S:g}",
           **dict(kv.split("=", 1) for kv in args.env)}
    if args.probe:
        (args.out / "memprobe").mkdir(exist_ok=True)
        env.update(PDSERVE_MEMPROBE=str(args.out / "memprobe"),
                   PYTHONPATH=f"{ROOT / 'bench' / 'memprobe'}:{cluster.env['PYTHONPATH']}")
    cluster.env.update(env)
    cluster.start(timeout=300)
    series: list[dict] = []
    t0 = time.monotonic()

    def sample(done: int) -> None:
        row = {"requests": done, "t": round(time.monotonic() - t0, 1)}
        for node in cluster.nodes:
            row[node.role] = rss_kb(node.proc.pid)
        series.append(row)
        print(json.dumps(row), flush=True)

    try:
        sample(0)
        errors = asyncio.run(_drive(cluster.http_url, ModelInfo.from_folder(folder).name,
                                    vocab, args.requests, args.concurrency, args.every,
                                    sample, 0))
    finally:
        cluster.stop()
    base = next((r for r in series if r["requests"] >= args.warmup), series[0])
    end = series[-1]
    n = max(1, end["requests"] - base["requests"])
    result = {"model": args.model, "env": env, "requests": args.requests,
              "errors": len(errors), "first_errors": errors[:5],
              "seconds": round(time.monotonic() - t0, 1), "baseline_at": base["requests"]}
    for role in ("prefill", "decode"):
        result[role] = {"start_mb": round(series[0][role] / 1024, 1),
                        "baseline_mb": round(base[role] / 1024, 1),
                        "end_mb": round(end[role] / 1024, 1),
                        "kb_per_request": round((end[role] - base[role]) / n, 2)}
    (args.out / "prefill_rss.json").write_text(json.dumps({**result, "series": series},
                                                          indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
