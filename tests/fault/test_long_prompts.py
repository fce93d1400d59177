"""2 prefill + 2 decode nodes, 32 concurrent prompts of 1,500 tokens, rounds without a
fault: no request fails and no prefill is redone (the router replayed nothing).

The decode nodes grant short reservation leases (LEASE_S, far below the router's 30 s
ask) on purpose. A lease must not expire for work that is merely queued: the prefill node
opens the push as soon as it accepts the request and keeps the reservation alive with
keepalives sized to the granted lease (a quarter of it; the router passes the grant). A
lease that expired would show as a redone prefill: pdserve_router_replays_total moves.

On the issue's SmolLM2 run the queue was 30 s deep; this tiny model's is shorter, so the
lease is short too. `make soak` repeats the rounds (ROUNDS here)."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM
from tests.integration.router_harness import (
    NODE_ARGS,
    Req,
    counter_total,
    reference,
    run_batch,
    scrape,
    start_cluster,
    tiny_model_folder,
)
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(600)

MODEL = "qwen2-long"
NUM_PROMPTS, PROMPT_LEN, ROUNDS = 32, 1500, 2
LEASE_S = 1.0
BLOCK, BLOCKS = 16, 3200          # room for every prompt on one node, prefix cache included
ARGS = NODE_ARGS + ["--block-size", str(BLOCK), "--num-gpu-blocks", str(BLOCKS)]
ENGINE = dict(dtype="float32", block_size=BLOCK, num_gpu_blocks=BLOCKS)


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("models"), MODEL)


@pytest.fixture(scope="module")
def cluster(long_folder, tmp_path_factory):
    c = start_cluster(long_folder, tmp_path_factory.mktemp("cluster-2x2"), prefill=2,
                      decode=2, node_args=ARGS, decode_args=["--lease-s", str(LEASE_S)])
    yield c
    c.stop()


def _round(seed: int) -> list[Req]:
    vias = ["http-stream", "grpc-stream", "http", "grpc"]
    prompts = random_prompts(NUM_PROMPTS, [PROMPT_LEN], 320, seed=seed)
    return [Req(vias[i % 4], p, 6 + i % 5) for i, p in enumerate(prompts)]


def test_2p2d_long_prompts_no_failure_and_no_redone_prefill(cluster, long_folder):
    llm = LLM(long_folder, **ENGINE)
    for r in range(ROUNDS):
        reqs = _round(seed=100 + r)            # new prompts each round: no prefix cache hits
        want = [reference(llm, q) for q in reqs]
        before = scrape(cluster.http_url)
        got = asyncio.run(run_batch(cluster.http_url, cluster.grpc_address, MODEL, reqs))
        after = scrape(cluster.http_url)
        for i, req in enumerate(reqs):
            assert got[i] == want[i], f"round {r}, request {i} ({req.via})"
        for name in ("pdserve_router_replays", "pdserve_router_node_failures"):
            moved = counter_total(after, name) - counter_total(before, name)
            assert moved == 0, f"round {r}: {name} went up by {moved:.0f}"
