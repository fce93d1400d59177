"""Discovery records, the in-memory registry and ClusterView (the etcd registry has the
same interface and is exercised against a real etcd in tests/integration)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.discovery import ClusterView, MemoryRegistry, MemoryStore, NodeLoad, NodeRecord
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
    assert NodeLoad.from_json(load.to_json()) == load
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
