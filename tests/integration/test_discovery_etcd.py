"""The etcd registry against a real etcd: a node keeps serving and keeps retrying while
etcd is away, registers once it is back, and a watching router resynchronises."""

from __future__ import annotations

import asyncio

import pytest

from cluster.discovery import ClusterView, EtcdRegistry, NodeLoad, NodeRecord
from launch.etcd_server import EtcdServer, free_port

pytestmark = pytest.mark.timeout(60)


def test_registration_survives_etcd_outage(tmp_path):
    port = free_port()

    async def body():
        node = EtcdRegistry(f"127.0.0.1:{port}", "out", ttl=2, timeout=1)
        await node.register(NodeRecord("n1", "decode", "127.0.0.1:9", "inc"))
        assert not await node.wait_registered(1.5)       # no etcd yet: not registered...
        server = EtcdServer(tmp_path / "etcd", client_port=port).start()
        try:
            assert await node.wait_registered(10)        # ...retried until it is there
            await node.publish_load(NodeLoad(running=1))
            view = ClusterView(EtcdRegistry(f"127.0.0.1:{port}", "out"))
            await view.start()
            assert [r.node_id for r in view.nodes("decode")] == ["n1"]
            assert await view.wait_for(lambda v: v.load("decode", "n1") is not None, 5)
            server.stop()                                 # etcd goes away
            for _ in range(50):                          # the next keep-alive notices
                if not node.registered:
                    break
                await asyncio.sleep(0.1)
            assert not node.registered
            server = EtcdServer(tmp_path / "etcd", client_port=port).start()   # same data
            assert await node.wait_registered(15)         # re-registered with a new lease
            assert await view.wait_for(lambda v: bool(v.nodes("decode")), 15)
            await node.deregister()
            assert await view.wait_for(lambda v: not v.nodes("decode"), 5)
            await view.close()
        finally:
            await node.close()
            server.stop()
    asyncio.run(body())
