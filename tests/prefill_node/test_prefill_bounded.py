"""What a long-lived prefill node keeps per decode node stays bounded: decode nodes come
back on new ports (pdserve up) or IPs (Kubernetes), so per-address state must be dropped
once an address is gone: the KV transport's channels (closed after IDLE_CHANNEL_S unused,
never under a running call) and the decode gate's memory of addresses that left."""

from __future__ import annotations

import asyncio

from cluster.discovery import MemoryRegistry, MemoryStore, NodeRecord
from cluster.kv_transfer.grpc_transport import GrpcTransport
from prefill_node.decode_gate import DiscoveryDecodeGate


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_transport_channels_to_addresses_unused_for_long_are_closed_but_not_under_a_call():
    async def body():
        clock = Clock()
        t = GrpcTransport(idle_channel_s=300.0, clock=clock)
        for port in range(20000, 20040):               # 40 decode incarnations, a minute apart
            async with t._using(f"127.0.0.1:{port}"):
                pass
            clock.now += 60
        assert len(t._channels) <= 6, sorted(t._channels)
        assert t.has_channel("127.0.0.1:20039") and not t.has_channel("127.0.0.1:20000")
        async with t._using("10.0.0.1:1"):             # a call running for 10 minutes...
            clock.now += 600
            async with t._using("10.0.0.2:1"):
                pass
            assert t.has_channel("10.0.0.1:1")          # ...keeps its channel
        clock.now += 301
        async with t._using("10.0.0.2:1"):
            pass
        assert not t.has_channel("10.0.0.1:1") and len(t._channels) == 1
        await t.close()
    asyncio.run(body())


def test_decode_gate_forgets_every_address_gone_longer_than_its_grace():
    async def body():
        store = MemoryStore()
        gate = DiscoveryDecodeGate(MemoryRegistry("c", store), grace_s=0.2)
        await gate.start()
        for i in range(15):                            # 15 decode incarnations, one at a time
            node = MemoryRegistry("c", store)
            await node.register(NodeRecord("d1", "decode", f"10.0.0.5:{7000 + i}", f"i{i}"))
            await gate.view.wait_for(lambda v, i=i: [r.address for r in v.nodes("decode")]
                                     == [f"10.0.0.5:{7000 + i}"], 5.0)
            assert gate.allows(f"10.0.0.5:{7000 + i}")
            await node.deregister()
            await gate.view.wait_for(lambda v: not v.nodes("decode"), 5.0)
        await asyncio.sleep(0.3)
        assert not gate.allows("10.0.0.5:7014")
        remembered = dict(gate._last_seen)
        await gate.close()
        return remembered
    assert asyncio.run(body()) == {}
