"""Routing policies: exact picks; the router's block hashes equal the engine's."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.prefix_hash import prefix_block_hashes
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from router.node_pool import NodePool, NodeState
from router.policies import POLICIES, make_policy
from router.policies.base import RoutingRequest
from router.policies.prefix_aware import matched_blocks


def _node(i: int, role: str = "prefill", **kw) -> NodeState:
    return NodeState(node_id=f"{role}-{i}", role=role, address=f"127.0.0.1:{5000 + i}",
                     block_size=4, **kw)


def _req(tokens: list[int]) -> RoutingRequest:
    return RoutingRequest("r", tokens)


def test_registry_names_and_unknown_policy():
    assert set(POLICIES) == {"round-robin", "least-load", "prefix-cache-aware"}
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'.*least-load"):
        make_policy("fastest")


def test_round_robin_cycles_per_role_in_node_id_order():
    policy = make_policy("round-robin")
    pre = [_node(0), _node(1), _node(2)]
    dec = [_node(0, "decode"), _node(1, "decode")]
    picks = [policy.pick("prefill", pre, _req([1])).node_id for _ in range(4)]
    assert picks == ["prefill-0", "prefill-1", "prefill-2", "prefill-0"]
    assert [policy.pick("decode", dec, _req([1])).node_id for _ in range(3)] == [
        "decode-0", "decode-1", "decode-0"]


def test_least_load_picks_fewest_then_free_blocks_then_id():
    policy = make_policy("least-load")
    nodes = [_node(0, running=3), _node(1, running=1, waiting=1), _node(2, running=2)]
    # node 1 and 2 both have load 2; node 2 has more free blocks
    nodes[1].free_blocks, nodes[2].free_blocks = 10, 20
    assert policy.pick("prefill", nodes, _req([1])).node_id == "prefill-2"
    nodes[2].free_blocks = 10          # full tie: lower node id
    assert policy.pick("prefill", nodes, _req([1])).node_id == "prefill-1"
    nodes[0].running = 0               # now clearly least loaded
    assert policy.pick("prefill", nodes, _req([1])).node_id == "prefill-0"
    nodes[0].inflight = 5              # this router's own in-flight count counts as load
    assert policy.pick("prefill", nodes, _req([1])).node_id == "prefill-1"


def test_prefix_aware_prefers_longest_cached_prefix():
    prompt = list(range(10, 30))                     # 5 full blocks of 4
    hashes = prefix_block_hashes(prompt, 4)
    other = prefix_block_hashes(list(range(50, 70)), 4)
    nodes = [_node(0, block_hashes=frozenset(hashes[:2])),
             _node(1, block_hashes=frozenset(hashes[:4] + other)),
             _node(2, block_hashes=frozenset(other))]
    req = _req(prompt)
    assert [matched_blocks(n, req) for n in nodes] == [2, 4, 0]
    policy = make_policy("prefix-cache-aware", max_load_gap=2)
    assert policy.pick("prefill", nodes, req).node_id == "prefill-1"
    # a chain: holding blocks 1..3 without block 0 matches nothing
    nodes[1].block_hashes = frozenset(hashes[1:4])
    assert matched_blocks(nodes[1], req) == 0
    assert policy.pick("prefill", nodes, req).node_id == "prefill-0"


def test_prefix_aware_bounded_by_load_gap_and_falls_back_to_least_load():
    prompt = list(range(10, 30))
    hashes = prefix_block_hashes(prompt, 4)
    nodes = [_node(0, running=5, block_hashes=frozenset(hashes)), _node(1, running=2),
             _node(2, running=1)]
    policy = make_policy("prefix-cache-aware", max_load_gap=3)
    # node 0 holds everything but is 4 busier than node 2 (> gap 3): least-load wins
    assert policy.pick("prefill", nodes, _req(prompt)).node_id == "prefill-2"
    nodes[0].running = 4               # within the gap now
    assert policy.pick("prefill", nodes, _req(prompt)).node_id == "prefill-0"
    # no hits anywhere: least load
    assert policy.pick("prefill", nodes, _req([7] * 20)).node_id == "prefill-2"
    with pytest.raises(ValueError, match="max_load_gap"):
        make_policy("prefix-cache-aware", max_load_gap=-1)


def test_router_hashes_equal_the_block_managers_registered_hashes():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = [5, 9, 2, 7, 1, 1, 3, 8, 4, 6, 0, 2, 9]          # 3 full blocks + 1
    seq = Sequence(tokens, SamplingParams())
    assert bm.allocate(seq)
    seq.num_cached_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    assert set(bm.cached_block_hashes()) == set(prefix_block_hashes(tokens, 4))
    assert len(prefix_block_hashes(tokens, 4)) == 3


def test_node_pool_failed_node_on_hold_comes_back_if_still_registered(monkeypatch):
    import router.node_pool as node_pool

    now = [1000.0]
    monkeypatch.setattr(node_pool.time, "monotonic", lambda: now[0])
    pool = NodePool(failed_hold_s=10.0)
    pool.upsert(_node(0, incarnation="a"))
    pool.upsert(_node(1, incarnation="b"))
    pool.mark_failed("prefill-0")
    now[0] += 9.9
    assert [n.node_id for n in pool.nodes("prefill")] == ["prefill-1"]
    now[0] += 0.1                                   # hold over, discovery still lists it
    assert [n.node_id for n in pool.nodes("prefill")] == ["prefill-0", "prefill-1"]
    pool.mark_failed("prefill-1")
    pool.remove("prefill-1")                        # its lease ended: gone for good
    now[0] += 60
    assert [n.node_id for n in pool.nodes("prefill")] == ["prefill-0"]


def test_node_pool_failed_node_stays_out_until_new_incarnation():
    pool = NodePool(failed_hold_s=60.0)
    pool.upsert(_node(0, incarnation="a"))
    pool.upsert(_node(1, incarnation="b"))
    pool.mark_failed("prefill-0")
    assert [n.node_id for n in pool.nodes("prefill")] == ["prefill-1"]
    pool.upsert(_node(0, incarnation="a"))          # a stale re-put of the dead process
    assert [n.node_id for n in pool.nodes("prefill")] == ["prefill-1"]
    pool.upsert(_node(0, incarnation="c"))          # restarted
    assert [n.node_id for n in pool.nodes("prefill")] == ["prefill-0", "prefill-1"]
    pool.remove("prefill-1")
    assert [n.node_id for n in pool.nodes("prefill")] == ["prefill-0"]
    assert pool.nodes("decode") == []
