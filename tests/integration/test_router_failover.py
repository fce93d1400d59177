"""2 prefill x 2 decode nodes behind one router, real processes, real etcd on 127.0.0.1.

- The mixed concurrent batch equals the single-node LLM (tokens and text).
- A decode node killed (SIGKILL) in the middle of a streamed request: the router replays
  prompt + streamed tokens on the other pair; the client's stream goes on with nothing lost
  or repeated, and ends equal to the single-node output.
- A node stopped with SIGTERM while requests are in flight: it leaves routing within the
  lease TTL and no request fails.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import pytest

from tests.integration.router_harness import (
    LEASE_TTL,
    MODEL,
    Req,
    metric_values,
    mixed_batch,
    reference,
    router_inflight,
    run_batch,
    scrape,
    start_cluster,
    stream_killing_the_busy_decode,
    wait_for,
)

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def cluster(folder, tmp_path_factory):
    c = start_cluster(folder, tmp_path_factory.mktemp("cluster-2x2"), prefill=2, decode=2)
    yield c
    c.stop()


def test_pd_2x2_equals_single_node_llm(cluster, llm):
    reqs = mixed_batch() + mixed_batch()          # 16 concurrent requests over 2 pairs
    outs = asyncio.run(run_batch(cluster.http_url, cluster.grpc_address, MODEL, reqs))
    for i, (req, got) in enumerate(zip(reqs, outs, strict=True)):
        assert got == reference(llm, req), f"request {i} ({req.via})"
    served = metric_values(scrape(cluster.http_url), "pdserve_node_free_kv_blocks")
    assert sorted(served) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]


def test_decode_node_killed_mid_stream_replays_without_loss(cluster, llm):
    prompt = [11, 12, 13, 14, 15, 16, 17]
    want_tokens, want_text, want_finish = reference(llm, Req("http", prompt, 480))
    # 480 tokens after a 7-token prompt (the model allows 512), the kill after the first
    # 3 arrive: the decode node is still generating when it dies, even on a loaded machine
    def kill(node) -> None:
        node.signal(signal.SIGKILL)
        node.wait(10)

    tokens, text, finish, killed = asyncio.run(
        stream_killing_the_busy_decode(cluster, MODEL, prompt, 480, kill))
    assert killed, "the request finished before a node could be killed"
    assert len(tokens) == len(want_tokens) == 480
    assert tokens == want_tokens and text == want_text and finish == want_finish
    metrics = scrape(cluster.http_url)
    replays = float(re.search(r"^pdserve_router_replays_total (\S+)$", metrics, re.M)[1])
    assert replays >= 1, cluster.router.log_tail()
    assert killed[0] not in metric_values(metrics, "pdserve_node_free_kv_blocks")


def test_sigterm_node_leaves_routing_within_lease_ttl_and_no_request_fails(cluster, llm):
    # the previous test killed one decode node: bring a fresh one in first
    fresh = cluster.add_node("decode", index=2)
    cluster.wait_ready([fresh], 120)
    assert wait_for(lambda: "decode-2" in router_inflight(cluster.http_url), 10)

    def decode_nodes() -> list[str]:
        return [n for n in router_inflight(cluster.http_url) if n.startswith("decode")]

    # the node SIGKILLed by the previous test stays listed until its lease runs out
    assert wait_for(lambda: len(decode_nodes()) == 2, 4 * LEASE_TTL + 10), decode_nodes()
    decodes = decode_nodes()

    reqs = [Req("http" if i % 2 else "grpc-stream", [20 + i, 30, 40, 50 + i, 60], 40)
            for i in range(12)]
    results: dict[int, tuple] = {}
    gone_after: list[float] = []

    def stop_one():
        # once a few requests are in flight on both decode nodes, SIGTERM one of them
        wait_for(lambda: len(results) >= 2, 60, 0.02)
        node = next(c for c in cluster.nodes if c.name == "decode-2")
        t0 = time.monotonic()
        node.signal(signal.SIGTERM)
        # a drained node deregisters at once; the lease TTL bounds it even if that is lost
        # (slack for a loaded CI machine, where the watch event can lag a little)
        if wait_for(lambda: "decode-2" not in router_inflight(cluster.http_url), 2 * LEASE_TTL + 1,
                    0.05):
            gone_after.append(time.monotonic() - t0)
        assert node.wait(60) == 0

    async def body():
        sem = asyncio.Semaphore(4)

        async def one(i, req):
            async with sem:
                (out,) = await run_batch(cluster.http_url, cluster.grpc_address, MODEL, [req])
                results[i] = out
        await asyncio.gather(*[one(i, r) for i, r in enumerate(reqs)])

    stopper = threading.Thread(target=stop_one)
    stopper.start()
    asyncio.run(body())
    stopper.join(90)
    assert gone_after, "the SIGTERMed node was still routed to after the lease TTL"
    for i, req in enumerate(reqs):
        assert results[i] == reference(llm, req), f"request {i}"
    assert sorted(n for n in router_inflight(cluster.http_url) if n.startswith("decode")) == sorted(
        set(decodes) - {"decode-2"})
