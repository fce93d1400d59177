"""500 concurrent streams against 1 prefill + 1 decode node whose KV cache holds a small
part of them, with the router's admission queue bound at 1,000 (its default): no request
is refused (429) and none fails; every text equals the single-node run's.

The decode node is made small on purpose (QUEUE_BLOCKS), so most requests must wait in the
router's FIFO for room; the test checks that they did (pdserve_router_queued_requests seen
above 100), so it cannot pass by never queueing. The wait bound (--queue-timeout) is set
past the whole run: this test is about the depth bound, which 500 is inside."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import ClientSession, ClientTimeout, TCPConnector

from router.client import AsyncGenerationClient
from tests.integration.router_harness import (
    MODEL,
    NODE_ARGS,
    scrape,
    start_cluster,
)
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(900)

NUM_STREAMS, QUEUE_DEPTH = 500, 1000
QUEUE_BLOCKS = 96                 # block size 4: room for about 20 of these at once
ARGS = NODE_ARGS + ["--num-gpu-blocks", str(QUEUE_BLOCKS)]


@pytest.fixture(scope="module")
def cluster(folder, tmp_path_factory):
    c = start_cluster(folder, tmp_path_factory.mktemp("cluster-1x1"), prefill=1, decode=1,
                      node_args=ARGS, router_args=["--queue-depth", str(QUEUE_DEPTH),
                                                   "--queue-timeout", "600"])
    yield c
    c.stop()


def _queued(http_url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(scrape(http_url)):
        if fam.name == "pdserve_router_queued_requests":
            return fam.samples[0].value
    raise AssertionError("pdserve_router_queued_requests missing from /metrics")


async def _http_stream(http: ClientSession, base: str, prompt: list[int], n: int):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": True, "return_token_ids": True}
    async with http.post(base + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, await resp.text()
        tokens, finish = [], None
        async for line in resp.content:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return "error", event
                tokens += event["choices"][0].get("token_ids", [])
                finish = event["choices"][0].get("finish_reason") or finish
        return 200, tokens, finish


async def _grpc_stream(client: AsyncGenerationClient, prompt: list[int], n: int):
    import grpc
    try:
        tokens, finish = [], None
        async for chunk in client.stream(prompt, max_tokens=n, temperature=0.0):
            tokens += chunk.token_ids
            finish = chunk.finish_reason or finish
        return 200, tokens, finish
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details()


def test_500_concurrent_streams_queue_and_none_is_refused(cluster, llm):
    from engine import SamplingParams

    prompts = random_prompts(NUM_STREAMS, [5, 9, 14], 320, seed=5)
    lens = [4 + i % 5 for i in range(NUM_STREAMS)]
    want = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(max_tokens=n, temperature=0.0) for n in lens])]
    deepest = [0.0]
    done = threading.Event()

    def watch():
        while not done.wait(0.05):
            deepest[0] = max(deepest[0], _queued(cluster.http_url))

    async def body():
        # no connection cap on the client side: all 500 are open at once
        async with ClientSession(connector=TCPConnector(limit=0),
                                 timeout=ClientTimeout(total=None)) as http, \
                AsyncGenerationClient(cluster.grpc_address) as client:
            return await asyncio.gather(*[
                _grpc_stream(client, p, n) if i % 4 == 3
                else _http_stream(http, cluster.http_url, p, n)
                for i, (p, n) in enumerate(zip(prompts, lens, strict=True))])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        got = asyncio.run(body())
    finally:
        done.set()
        watcher.join()
    refused = [(i, g) for i, g in enumerate(got) if g[0] != 200]
    assert not refused, f"{len(refused)} of {NUM_STREAMS} not served, e.g. {refused[:3]}"
    wrong = [i for i, g in enumerate(got) if g[1] != want[i]]
    assert not wrong, f"{len(wrong)} texts differ from the single-node run, e.g. " + \
        "; ".join(f"{i}: {prompts[i]} got {got[i][1:]} want {want[i]}" for i in wrong[:5])
    print(f"deepest admission queue seen: {deepest[0]:.0f}")
    assert deepest[0] > 100, f"the queue was never used (deepest {deepest[0]:.0f})"
    assert _queued(cluster.http_url) == 0
