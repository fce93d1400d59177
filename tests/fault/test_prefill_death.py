"""A prefill node SIGKILLed, or SIGSTOPped (hung), while it holds prefills and pushes
(2 prefill + 1 decode nodes, real processes, real etcd on 127.0.0.1): every request it
held is replayed on the other prefill node within REPLAY_S of the kill, or of discovery
dropping the hung node (its etcd lease runs out: LEASE_TTL), not after the 30 s
reservation lease; no request fails and every text equals the single-node run's.

The replay time is read from the router's own counters, polled every 10 ms:
pdserve_router_replays_total reaches (before + what the node held) at most REPLAY_S
after the kill (SIGKILL: the gRPC connection breaks at once) or after the node leaves the
router's pool (SIGSTOP: `NodePool.removal` ends its pending prefills)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from engine import LLM
from tests.integration.router_harness import (
    NODE_ARGS,
    Req,
    counter_total,
    reference,
    router_inflight,
    run_batch,
    scrape,
    start_cluster,
    tiny_model_folder,
    wait_for,
)
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(600)

MODEL = "qwen2-long"
NUM_PROMPTS, PROMPT_LEN = 24, 1200
REPLAY_S = 3.0
BLOCK, BLOCKS = 16, 2400
ARGS = NODE_ARGS + ["--block-size", str(BLOCK), "--num-gpu-blocks", str(BLOCKS)]


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("models"), MODEL)


@pytest.fixture(scope="module")
def long_llm(long_folder):
    return LLM(long_folder, dtype="float32", block_size=BLOCK, num_gpu_blocks=BLOCKS)


@pytest.fixture(scope="module")
def cluster(long_folder, tmp_path_factory):
    c = start_cluster(long_folder, tmp_path_factory.mktemp("cluster-2x1"), prefill=2,
                      decode=1, node_args=ARGS)
    yield c
    for node in c.nodes:               # a stopped node cannot drain
        node.signal(signal.SIGCONT)
    c.stop()


def _replays(http_url: str) -> float:
    return counter_total(scrape(http_url), "pdserve_router_replays")


def _fault_during_batch(cluster, llm, sig: int, seed: int) -> dict:
    """Send the batch, hit the first prefill node seen holding work with `sig`, and time
    the router's replay of what it held. Returns the figures; asserts the texts."""
    reqs = [Req(["http-stream", "grpc-stream", "http", "grpc"][i % 4], p, 4 + i % 4)
            for i, p in enumerate(random_prompts(NUM_PROMPTS, [PROMPT_LEN], 320, seed=seed))]
    want = [reference(llm, r) for r in reqs]
    seen: dict = {}

    def fault():
        busy: list = []

        def prefill_busy() -> bool:
            now = router_inflight(cluster.http_url)
            busy[:] = [(n, v) for n, v in now.items() if n.startswith("prefill") and v > 0]
            return bool(busy)
        before = _replays(cluster.http_url)
        assert wait_for(prefill_busy, 120, 0.005), router_inflight(cluster.http_url)
        name, held = busy[0]
        node = next(c for c in cluster.nodes if c.name == name)
        seen.update(name=name, node=node, t_fault=time.monotonic())
        node.signal(sig)
        if sig == signal.SIGSTOP:         # the clock starts when discovery drops it
            assert wait_for(lambda: name not in router_inflight(cluster.http_url), 60, 0.01)
            seen["t_drop"] = time.monotonic()
            seen["drop_s"] = seen["t_drop"] - seen["t_fault"]
        start = seen.get("t_drop", seen["t_fault"])
        # what it held: at least what the router counted just before the fault
        assert wait_for(lambda: _replays(cluster.http_url) >= before + held, 60, 0.01)
        seen.update(replay_s=time.monotonic() - start, held=held)

    async def body():
        return await run_batch(cluster.http_url, cluster.grpc_address, MODEL, reqs)

    watcher = threading.Thread(target=fault)
    watcher.start()
    got = asyncio.run(body())
    watcher.join(120)
    for i, req in enumerate(reqs):
        assert got[i] == want[i], f"request {i} ({req.via})"
    assert "replay_s" in seen, f"no replay seen: {seen}"
    print(f"{signal.Signals(sig).name}: {seen['held']:.0f} held requests replayed "
          f"{seen['replay_s']:.2f} s after the {'drop' if 't_drop' in seen else 'kill'}"
          + (f" (dropped {seen['drop_s']:.2f} s after the stop)" if "drop_s" in seen else ""))
    return seen


def test_hung_prefill_node_requests_replay_when_discovery_drops_it(cluster, long_llm):
    seen = _fault_during_batch(cluster, long_llm, signal.SIGSTOP, seed=11)
    assert seen["replay_s"] < REPLAY_S, seen
    node = seen["node"]
    node.signal(signal.SIGCONT)        # it wakes, finds its etcd lease gone, registers again
    assert wait_for(lambda: seen["name"] in router_inflight(cluster.http_url), 60, 0.1), \
        node.log_tail()


def test_killed_prefill_node_requests_replay_at_once(cluster, long_llm):
    seen = _fault_during_batch(cluster, long_llm, signal.SIGKILL, seed=12)
    assert seen["replay_s"] < REPLAY_S, seen
    assert seen["node"].wait(10) == -signal.SIGKILL
