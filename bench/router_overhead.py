"""What the router's fronts cost, against a peer in the same run.

    python bench/router_overhead.py [--model DIR] [--requests 16] [--concurrency 4]
                                    [--prompt-len 64] [--max-tokens 32] [--rounds 2]

One local cluster (etcd, 1 prefill node, 1 decode node, 1 router; real processes). The same
kind of requests (random token-id prompts, greedy, fixed length, ignore_eos) go three ways,
interleaved round by round so machine noise hits all alike:
  - peer "pd-driver": the router's own PD driver (router/pd_backend.PdBackend) in this
    process, straight to the nodes: reservation, prefill, token stream; no HTTP, no gRPC
    front, no detokenization;
  - "router-http": POST /v1/completions with stream: true (SSE), through the router;
  - "router-grpc": pdserve.v1.Generation/Generate (server streaming), through the router.
Every request has its own prompt, so no mode gains from another's prefix cache.
Printed: the standard serving table (TTFT, TPOT, ITL: mean / median / p99; output tokens/s)
and each front's ratio to the peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


class Trace:
    """Arrival times of one request's token batches."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.tokens = 0

    def got(self, n: int) -> None:
        if n:
            self.times.append(time.perf_counter())
            self.tokens += n


async def run_driver(backend, prompt, max_tokens, rid) -> Trace:
    from engine.sampling_params import SamplingParams
    from router.backend import NodeRequest

    t = Trace()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for step in backend.generate(NodeRequest(rid, prompt, params)):
        t.got(len(step.token_ids))
    return t


async def run_http(session, url, model, prompt, max_tokens) -> Trace:
    t = Trace()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.reason == "OK", await resp.text()
        async for line in resp.content:
            line = line.strip()
            if line.startswith(b"data: {"):
                t.got(len(json.loads(line[6:])["choices"][0].get("token_ids", [])))
    return t


async def run_grpc(client, prompt, max_tokens) -> Trace:
    t = Trace()
    async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0,
                                     ignore_eos=True):
        t.got(len(chunk.token_ids))
    return t


async def run_mode(mode: str, ctx: dict, prompts: list[list[int]], max_tokens: int,
                   concurrency: int) -> tuple[list[Trace], float]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i, prompt):
        async with sem:
            if mode == "pd-driver":
                return await run_driver(ctx["backend"], prompt, max_tokens,
                                        f"bench-{ctx['round']}-{i}")
            if mode == "router-http":
                return await run_http(ctx["session"], ctx["http"], ctx["model"], prompt,
                                      max_tokens)
            return await run_grpc(ctx["grpc"], prompt, max_tokens)

    t0 = time.perf_counter()
    traces = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return list(traces), time.perf_counter() - t0


def summarize(traces: list[Trace], wall: float) -> dict:
    ttft = [t.times[0] - t.start for t in traces]
    tpot = [(t.times[-1] - t.times[0]) / (t.tokens - 1) for t in traces if t.tokens > 1]
    itl = [b - a for t in traces for a, b in zip(t.times, t.times[1:], strict=False)]
    tokens = sum(t.tokens for t in traces)
    out = {"output tok/s": tokens / wall}
    for name, xs in (("TTFT ms", ttft), ("TPOT ms", tpot), ("ITL ms", itl)):
        out[f"{name} mean"] = 1000 * statistics.fmean(xs)
        out[f"{name} median"] = 1000 * statistics.median(xs)
        out[f"{name} p99"] = 1000 * _pct(xs, 0.99)
    return out


async def bench(args, cluster, model_name: str, vocab: int) -> dict[str, list]:
    from aiohttp import ClientSession

    from router.client import AsyncGenerationClient
    from router.metrics import RouterMetrics
    from router.node_pool import NodePool, NodeState
    from router.pd_backend import PdBackend
    from router.policies import make_policy

    pool = NodePool()
    for child in cluster.nodes:
        role = child.name.split("-")[0]
        pool.upsert(NodeState(child.name, role, child.ready(), incarnation="bench"))
    backend = PdBackend(pool, make_policy("round-robin"), RouterMetrics(pool),
                        max_model_len=10**9)
    rng = random.Random(0)
    modes = ("pd-driver", "router-http", "router-grpc")
    results: dict[str, list] = {m: [] for m in modes}
    async with ClientSession() as session, AsyncGenerationClient(cluster.grpc_address) as gc:
        ctx = {"backend": backend, "session": session, "http": cluster.http_url,
               "grpc": gc, "model": model_name}
        # warm-up: one request each way
        for mode in modes:
            ctx["round"] = f"warm-{mode}"
            await run_mode(mode, ctx, [[rng.randrange(3, vocab) for _ in range(8)]], 4, 1)
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                ctx["round"] = f"{r}-{mode}"
                prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                           for _ in range(args.requests)]
                traces, wall = await run_mode(mode, ctx, prompts, args.max_tokens,
                                              args.concurrency)
                results[mode].append((traces, wall))
                print(f"round {r} {mode}: {wall:.2f} s", flush=True)
    await backend.close()
    return results


def report(results: dict[str, list]) -> str:
    rows = {}
    for mode, runs in results.items():
        traces = [t for ts, _ in runs for t in ts]
        rows[mode] = summarize(traces, sum(w for _, w in runs))
    peer = rows["pd-driver"]
    keys = list(peer)
    head = f"{'metric':<20}" + "".join(f"{m:>14}" for m in rows) + \
        "".join(f"{m + '/peer':>19}" for m in rows if m != "pd-driver")
    lines = [head, "-" * len(head)]
    for k in keys:
        line = f"{k:<20}" + "".join(f"{rows[m][k]:>14.2f}" for m in rows)
        line += "".join(f"{rows[m][k] / peer[k]:>18.2f}x" for m in rows if m != "pd-driver")
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: the prepared default)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)

    from launch.local_cluster import LocalCluster, LocalClusterConfig
    from router.model_info import ModelInfo

    model = args.model
    if model is None:
        from launch.default_model import prepare_default_model
        model = str(prepare_default_model(progress=True))
    info = ModelInfo.from_folder(model)
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-router-"))
    print(f"model {info.name}, {args.requests} requests x {args.rounds} rounds per mode, "
          f"prompt {args.prompt_len} tokens, {args.max_tokens} output tokens, concurrency "
          f"{args.concurrency}; logs in {run_dir}", flush=True)
    cluster = LocalCluster(LocalClusterConfig(
        model=model, http_port=0, grpc_port=0, cluster="bench", policy="round-robin",
        node_args=["--dtype", args.dtype, "--max-num-seqs", str(max(8, args.concurrency))],
        run_dir=run_dir)).start(timeout=300)
    try:
        results = asyncio.run(bench(args, cluster, info.name, info.vocab_size))
    finally:
        cluster.stop()
    print("\n" + report(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
