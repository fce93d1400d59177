"""Tensor-parallel decode nodes (2 ranks each) behind a router, real processes, real etcd on
127.0.0.1: one decode node's rank is killed (SIGKILL) in the middle of a streamed request.
The node cannot compute without it and exits at once (engine/parallel/rank_worker.py), so
the router replays prompt + streamed tokens on the other decode node; the client's stream
goes on with nothing lost or repeated, and gives the single-node output (compared up to
the first near-tie of the single-node run: tensor parallel's sums differ from one rank's
within the tolerance of tests/engine/test_tensor_parallel.py)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import pytest

from engine import SamplingParams
from tests.engine.test_tensor_parallel import _exact_prefix
from tests.integration.router_harness import (
    MODEL,
    metric_values,
    scrape,
    start_cluster,
    stream_killing_the_busy_decode,
)

pytestmark = pytest.mark.timeout(400)
MAX_NEW = 200


@pytest.fixture(scope="module")
def cluster(folder, tmp_path_factory):
    c = start_cluster(folder, tmp_path_factory.mktemp("cluster-tp"), prefill=1, decode=2,
                      decode_args=["--tensor-parallel-size", "2"])
    yield c
    c.stop()


def _rank_of(pid: int) -> int:
    """The spawned rank process of node `pid` (not multiprocessing's resource tracker)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(c) for c in (task / "children").read_text().split()]
    (rank,) = [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    return rank


def test_a_decode_nodes_lost_rank_mid_stream_is_replayed_without_loss(cluster, llm):
    prompt = [11, 12, 13, 14, 15, 16, 17]
    want = llm.generate([{"prompt_token_ids": prompt}],
                        SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                       logprobs=2))[0].outputs[0]
    exact = _exact_prefix(want)
    def kill(node) -> None:
        os.kill(_rank_of(node.proc.pid), signal.SIGKILL)
        assert node.proc.wait(60) == 70      # the node exits for its rank

    tokens, _, _, killed = asyncio.run(
        stream_killing_the_busy_decode(cluster, MODEL, prompt, MAX_NEW, kill))
    assert killed, "the request finished before a rank could be killed"
    assert len(tokens) == MAX_NEW
    assert tokens[:exact] == want.token_ids[:exact]
    metrics = scrape(cluster.http_url)
    replays = float(re.search(r"^pdserve_router_replays_total (\S+)$", metrics, re.M)[1])
    assert replays >= 1, cluster.router.log_tail()
    assert killed[0] not in metric_values(metrics, "pdserve_node_free_kv_blocks")
    node = next(c for c in cluster.nodes if c.name == killed[0])
    assert "the group cannot go on: the node exits" in node.log_tail(20000)
