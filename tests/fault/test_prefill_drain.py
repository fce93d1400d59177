"""A prefill node SIGTERMed while 64 streams run (2 prefill + 1 decode nodes, real
processes, real etcd on 127.0.0.1): no request fails, every text equals the undisturbed
single-node run's, and the node exits 0 after its drain.

Its drain: leave discovery first (the router then replays any prefill still pending on it
on the other node: `NodePool.removal`), refuse new prefills with a replay hint, finish
the pushes it started, exit. Requests keep arriving after the SIGTERM.

Run it 20 times with a CPU hog beside it (two busy processes):

    for i in 1 2; do (timeout 3000 sh -c 'while :; do :; done' &) ; done
    for i in $(seq 20); do .venv/bin/python -m pytest -q -p no:cacheprovider \\
        tests/fault/test_prefill_drain.py || break; done
    pkill -f 'while :; do :; done'
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading

import pytest

from tests.integration.router_harness import (
    MODEL,
    Req,
    Stall,
    check_stream_waits,
    reference,
    router_inflight,
    run_batch,
    start_cluster,
    wait_for,
)

pytestmark = pytest.mark.timeout(400)

NUM_STREAMS = 64


@pytest.fixture(scope="module")
def cluster(folder, tmp_path_factory):
    c = start_cluster(folder, tmp_path_factory.mktemp("cluster-2x1"), prefill=2, decode=1)
    yield c
    c.stop()


def _requests() -> list[Req]:
    vias = ["http-stream", "grpc-stream", "http", "grpc"]
    return [Req(vias[i % 4], [60 + i, 5, 9 + i % 7, 13] * 12, 12 + i % 3 * 6)
            for i in range(NUM_STREAMS)]


def test_sigterm_prefill_node_during_64_streams_loses_nothing(cluster, llm):
    reqs = _requests()
    want = [reference(llm, r) for r in reqs]
    results: dict[int, tuple] = {}
    stalls: list[list[Stall]] = [[] for _ in reqs]
    drained: dict[str, object] = {}
    sent = threading.Event()

    def inflight() -> dict[str, float]:
        return router_inflight(cluster.http_url)

    def stop_one():
        # SIGTERM a prefill node as soon as the router has work on it
        busy: list[str] = []

        def prefill_busy() -> bool:
            busy[:] = [n for n, v in inflight().items() if n.startswith("prefill") and v > 0]
            return bool(busy)
        assert wait_for(prefill_busy, 120, 0.01), inflight()
        node = next(c for c in cluster.nodes if c.name == busy[0])
        drained["name"] = busy[0]
        node.signal(signal.SIGTERM)
        sent.set()
        drained["rc"] = node.wait(120)
        drained["log"] = node.log_tail(20000)

    async def body():
        async def one(i: int, req: Req):
            (out,) = await run_batch(cluster.http_url, cluster.grpc_address, MODEL, [req],
                                     stalls[i])
            results[i] = out

        half = NUM_STREAMS // 2
        first = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(reqs[:half])]
        await asyncio.to_thread(sent.wait, 150)        # the rest arrive after the SIGTERM
        rest = [one(half + i, r) for i, r in enumerate(reqs[half:])]
        await asyncio.gather(*first, *rest)

    stopper = threading.Thread(target=stop_one)
    stopper.start()
    asyncio.run(body())
    stopper.join(150)
    assert "rc" in drained, "the prefill node did not exit after SIGTERM"
    assert drained["rc"] == 0, drained["log"]
    assert re.search(r"drained$", drained["log"], re.M), drained["log"][-3000:]
    for i, req in enumerate(reqs):
        assert results[i] == want[i], f"request {i} ({req.via})"
    check_stream_waits(reqs, [s[0] for s in stalls])
    assert drained["name"] not in inflight()       # it left routing
