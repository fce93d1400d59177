"""etcd must not fill up: an idle node writes (almost) nothing, a load change is still
published, and a changing load is written at a bounded rate. The real node-side
publisher (cluster.node_server.Presence driving EtcdRegistry) against a real etcd; the
revision is read from etcd's response header, which counts every write."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.discovery import EtcdRegistry, NodeLoad, NodeRecord
from cluster.discovery.records import load_key
from cluster.node_server import Presence

pytestmark = pytest.mark.timeout(90)


async def _revision(client) -> int:
    return (await client.get_prefix(b"/pdserve/")).header.revision


async def _stored_load(client, key: bytes) -> NodeLoad | None:
    got = await client.get(key)
    return None if got is None else NodeLoad.from_json(got.value)


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        await asyncio.sleep(0.05)


def test_idle_node_writes_nothing_and_load_changes_are_published(etcd):
    import aetcd

    async def body():
        # ttl 10: a keep-alive every 3.3 s, so a loaded machine does not lose the lease
        registry = EtcdRegistry(etcd.endpoint, "flat", ttl=10, min_load_interval=0.5)
        record = NodeRecord("d0", "decode", "127.0.0.1:9", "inc1")
        key = load_key("flat", "decode", "d0").encode()
        current = {"load": NodeLoad(running=0, free_blocks=100,
                                    block_hashes=tuple(range(4096)), incarnation="inc1")}
        calls = [0]

        def load_fn() -> NodeLoad:
            calls[0] += 1
            # a fresh measurement each call (new ts), as the node's engine gives
            return NodeLoad(**{**current["load"].__dict__, "ts": time.time()})

        presence = Presence(registry, record, load_fn, interval=0.02)   # 25x the default
        client = aetcd.Client(*etcd.endpoint.split(":"))
        try:
            await presence.start(wait_s=10)
            assert registry.registered
            await _until(lambda: _stored_load(client, key), 10, "first load in etcd")

            # idle: ~100 publish calls of an unchanged load
            before, calls_before = await _revision(client), calls[0]
            await _until(lambda: asyncio.sleep(0, calls[0] >= calls_before + 100), 30,
                         "100 publish calls")
            idle_revisions = await _revision(client) - before
            # the old publisher wrote on every call (~100 revisions); allow one
            # re-registration should the lease keep-alive miss on a loaded machine
            assert idle_revisions <= 2, idle_revisions

            # a change is published (within the rate bound, so poll)
            current["load"] = NodeLoad(running=3, free_blocks=90,
                                       block_hashes=tuple(range(4100)), incarnation="inc1")

            async def published():
                stored = await _stored_load(client, key)
                return stored is not None and stored.running == 3 and 4099 in \
                    stored.block_hashes
            await _until(published, 10, "changed load in etcd")
            assert await _revision(client) > before + idle_revisions

            # a load changing on every call is written at most once per interval, and
            # its latest value still lands (trailing write)
            puts_before, t0 = registry.load_puts, time.monotonic()
            start = calls[0]
            while calls[0] < start + 60:
                current["load"] = NodeLoad(running=100 + calls[0], incarnation="inc1")
                await asyncio.sleep(0.01)
            final = current["load"].running
            elapsed = time.monotonic() - t0
            # rate bound, not a timing: a slow machine makes fewer writes, never more
            assert registry.load_puts - puts_before <= elapsed / 0.5 + 2
            assert registry.load_puts - puts_before >= 1

            async def final_published():
                stored = await _stored_load(client, key)
                return stored is not None and stored.running == final
            await _until(final_published, 10, "latest load in etcd")
        finally:
            await presence.stop()
            await client.close()

    asyncio.run(body())
