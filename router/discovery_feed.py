"""Keeps a NodePool in step with the discovery registry's watch (etcd or in-memory)."""

from __future__ import annotations

import asyncio
import logging

from cluster.discovery.prefix_digest import PrefixDigest
from cluster.discovery.records import NodeLoad, NodeRecord
from cluster.discovery.registry import Registry, WatchEvent
from router.node_pool import NodePool, NodeState

log = logging.getLogger("pdserve.router")


def node_state(record: NodeRecord) -> NodeState:
    fp = record.fingerprint or {}
    return NodeState(node_id=record.node_id, role=record.role, address=record.address,
                     model=record.model_id, incarnation=record.incarnation,
                     block_size=int(fp.get("block_size") or 16),
                     kernel_error=record.kernel_error)


def _apply_load(pool: NodePool, node_id: str, load: NodeLoad) -> None:
    node = pool.get(node_id)
    if node is None or (load.incarnation and load.incarnation != node.incarnation):
        return
    pool.update_load(node_id, running=load.running, waiting=load.waiting + load.reserved,
                     free_blocks=load.free_blocks, total_blocks=load.total_blocks,
                     block_hashes=_hash_set(load.block_hashes))


def _hash_set(hashes) -> frozenset[int] | PrefixDigest:
    """etcd delivers a PrefixDigest (a Bloom filter); the in-memory registry the node's
    own tuple. Policies only ask `h in node.block_hashes`, which both answer."""
    return hashes if isinstance(hashes, PrefixDigest) else frozenset(hashes)


def apply_event(pool: NodePool, ev: WatchEvent) -> None:
    if ev.kind == "snapshot":
        live = {r.node_id for r in ev.nodes.values()}
        for node in pool.all():
            if node.node_id not in live:
                pool.remove(node.node_id)
        for record in ev.nodes.values():
            pool.upsert(node_state(record))
        for key, load in ev.loads.items():
            _apply_load(pool, key.split("/", 1)[1], load)
    elif ev.kind == "put" and ev.record is not None:
        known = pool.get(ev.node_id) is not None
        pool.upsert(node_state(ev.record))
        if not known and pool.get(ev.node_id) is not None:
            log.info("node joined: %s %s at %s", ev.role, ev.node_id, ev.record.address)
    elif ev.kind == "delete":
        if pool.get(ev.node_id) is not None:
            log.info("node left: %s %s", ev.role, ev.node_id)
        pool.remove(ev.node_id)
    elif ev.kind == "load" and ev.load is not None:
        _apply_load(pool, ev.node_id, ev.load)


async def follow(registry: Registry, pool: NodePool) -> None:
    """Runs until cancelled; a broken watch is reopened (it starts with a fresh snapshot)."""
    while True:
        try:
            async for ev in registry.watch():
                apply_event(pool, ev)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - logged, then the watch is reopened
            log.warning("discovery watch failed (%s); reopening", exc)
        await asyncio.sleep(0.5)
