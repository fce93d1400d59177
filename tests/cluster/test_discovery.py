"""Discovery records, the in-memory registry and ClusterView (the etcd registry has the
same interface and is exercised against a real etcd in tests/integration)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.discovery import (
    ClusterView,
    MemoryRegistry,
    MemoryStore,
    NodeLoad,
    NodeRecord,
    PrefixDigest,
)
from cluster.discovery.etcd import parse_endpoints
from cluster.discovery.records import load_key, node_key, parse_key


def test_keys_and_records_round_trip():
    assert node_key("c", "decode", "n1") == "/pdserve/c/nodes/decode/n1"
    assert load_key("c", "prefill", "n2") == "/pdserve/c/load/prefill/n2"
    assert parse_key("c", "/pdserve/c/nodes/decode/n1") == ("nodes", "decode", "n1")
    assert parse_key("c", "/pdserve/other/nodes/decode/n1") is None
    assert parse_key("c", "/pdserve/c/nodes/router/n1") is None
    rec = NodeRecord("n1", "decode", "127.0.0.1:5", "inc", fingerprint={"dtype": "float32"})
    assert NodeRecord.from_json(rec.to_json()) == rec
    load = NodeLoad(running=2, block_hashes=(1, -5))
    back = NodeLoad.from_json(load.to_json())
    assert (back.running, back.ts) == (2, load.ts)
    assert 1 in back.block_hashes and -5 in back.block_hashes and 2 not in back.block_hashes
    with pytest.raises(ValueError, match="role"):
        NodeRecord("n1", "router", "a:1", "i")
    with pytest.raises(ValueError, match="cluster name"):
        MemoryRegistry("a/b")
    assert parse_endpoints("h1:1,http://h2:2") == [("h1", 1), ("h2", 2)]
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_endpoints("nohost")


def test_memory_registry_watch_snapshot_events_and_expiry():
    async def body():
        store = MemoryStore()
        node_a, node_b = MemoryRegistry("c", store), MemoryRegistry("c", store)
        await node_a.register(NodeRecord("a", "prefill", "h:1", "i1"))
        view = ClusterView(MemoryRegistry("c", store))
        await view.start()
        assert [r.node_id for r in view.nodes()] == ["a"]          # from the snapshot
        await node_b.register(NodeRecord("b", "decode", "h:2", "i2"))
        await node_b.publish_load(NodeLoad(running=3))
        assert await view.wait_for(lambda v: v.load("decode", "b") is not None, 1)
        assert view.load("decode", "b").running == 3
        assert [r.node_id for r in view.nodes("decode")] == ["b"]
        store.expire("c", "prefill", "a")                           # lease ran out
        assert await view.wait_for(lambda v: not v.nodes("prefill"), 1)
        assert not node_a.registered and node_b.registered
        await node_b.deregister()
        assert await view.wait_for(lambda v: not v.nodes(), 1)
        assert view.load("decode", "b") is None
        # another cluster's nodes are invisible
        await MemoryRegistry("other", store).register(NodeRecord("x", "decode", "h:3", "i"))
        await asyncio.sleep(0.01)
        assert view.nodes() == []
        await view.close()
    asyncio.run(body())


def test_load_record_carries_a_compact_prefix_digest_the_policy_can_use():
    from engine.prefix_hash import prefix_block_hashes
    from router.node_pool import NodeState
    from router.policies.base import RoutingRequest
    from router.policies.prefix_aware import PrefixCacheAwarePolicy, matched_blocks

    held = prefix_block_hashes(list(range(4096 * 4)), 4)           # the engine's cap: 4096
    raw = NodeLoad(running=1, block_hashes=tuple(held), incarnation="i").to_json()
    assert len(raw) < 8000          # the hash list as JSON was ~88 KB
    back = NodeLoad.from_json(raw)
    assert isinstance(back.block_hashes, PrefixDigest) and len(back.block_hashes) == 4096
    assert all(h in back.block_hashes for h in held)              # no false negatives
    others = prefix_block_hashes(list(range(10**6, 10**6 + 40000)), 4)
    false_hits = sum(h in back.block_hashes for h in others)
    assert false_hits < 0.03 * len(others), false_hits            # ~0.8% expected
    assert NodeLoad.from_json(back.to_json()) == back             # a digest re-encodes as is
    assert 5 not in PrefixDigest.of(()) and not PrefixDigest.of(())
    # a node from before the digest published the plain list; it still reads
    assert NodeLoad.from_json(b'{"block_hashes": [3, 4]}').block_hashes == (3, 4)

    prompt = list(range(100, 140))
    hashes = prefix_block_hashes(prompt, 4)
    nodes = [NodeState("a", "decode", "h:1", block_size=4,
                       block_hashes=PrefixDigest.of(hashes[:2])),
             NodeState("b", "decode", "h:2", block_size=4,
                       block_hashes=PrefixDigest.of(hashes[:7]))]
    req = RoutingRequest("r", prompt)
    assert [matched_blocks(n, req) for n in nodes] == [2, 7]
    assert PrefixCacheAwarePolicy().pick("decode", nodes, req).node_id == "b"


def test_load_sameness_ignores_only_the_time_of_measurement():
    a = NodeLoad(running=1, block_hashes=(1, 2), ts=1.0)
    assert a.same_as(NodeLoad(running=1, block_hashes=(1, 2), ts=2.0))
    assert not a.same_as(NodeLoad(running=2, block_hashes=(1, 2), ts=1.0))
    assert not a.same_as(NodeLoad(running=1, block_hashes=(1, 3), ts=1.0))
    assert not a.same_as(None)
