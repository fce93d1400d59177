"""etcd away under steady load (1 prefill + 1 decode nodes, router, real etcd on
127.0.0.1 with TLS): SIGSTOPped for OUTAGE_S (hung: every etcd call of the nodes and the
router times out, and when it wakes, the nodes' leases have run out), then SIGKILLed and
restarted on the same data. No request fails and every text equals the single-node run's:
the router keeps routing on the nodes it knew, and the nodes register again at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.integration.router_harness import (
    MODEL,
    Req,
    reference,
    router_inflight,
    run_batch,
    start_cluster,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)

OUTAGE_S = 30.0          # the figure


@pytest.fixture(scope="module")
def cluster(folder, tmp_path_factory):
    c = start_cluster(folder, tmp_path_factory.mktemp("cluster-1x1"), prefill=1, decode=1)
    yield c
    if c.etcd.proc is not None:
        os.kill(c.etcd.proc.pid, signal.SIGCONT)
    c.stop()


def _load(cluster, llm, until: float) -> tuple[int, list[str]]:
    """Batches of 6 mixed requests, one after another, until `until` (monotonic)."""
    vias = ["http-stream", "grpc-stream", "http", "grpc"]
    sent, wrong, i = 0, [], 0
    while time.monotonic() < until:
        reqs = [Req(vias[(i + k) % 4], [20 + (i + k) % 90, 4, 5 + k, 7], 6 + k % 3)
                for k in range(6)]
        got = asyncio.run(run_batch(cluster.http_url, cluster.grpc_address, MODEL, reqs))
        wrong += [f"{r.via} {r.prompt}" for r, g in zip(reqs, got, strict=True)
                  if g != reference(llm, r)]
        sent, i = sent + len(reqs), i + 6
    return sent, wrong


def _both_routed(cluster) -> bool:
    return {n.split("-")[0] for n in router_inflight(cluster.http_url)} == {"prefill",
                                                                             "decode"}


def test_etcd_hung_then_killed_loses_no_request(cluster, llm):
    pid = cluster.etcd.proc.pid
    os.kill(pid, signal.SIGSTOP)
    sent, wrong = _load(cluster, llm, time.monotonic() + OUTAGE_S)
    os.kill(pid, signal.SIGCONT)         # the nodes' leases expire now; they register again
    more, wrong2 = _load(cluster, llm, time.monotonic() + 5)
    assert not wrong + wrong2, (wrong + wrong2)[:5]
    assert sent > 0 and more > 0
    assert wait_for(lambda: _both_routed(cluster), 30, 0.2), router_inflight(cluster.http_url)

    cluster.etcd.proc.kill()             # gone: connections refused, then back on its data
    cluster.etcd.proc.wait()
    sent, wrong = _load(cluster, llm, time.monotonic() + 5)
    cluster.etcd.start()
    more, wrong2 = _load(cluster, llm, time.monotonic() + 5)
    assert not wrong + wrong2, (wrong + wrong2)[:5]
    assert wait_for(lambda: _both_routed(cluster), 30, 0.2), router_inflight(cluster.http_url)
    print(f"etcd away: {sent + more} requests after the kill, all exact")
