"""ClusterView: a router's live picture of the cluster, kept current by a registry watch."""

from __future__ import annotations

import asyncio
import logging

from cluster.discovery.records import NodeLoad, NodeRecord
from cluster.discovery.registry import Registry, WatchEvent

log = logging.getLogger("cluster.discovery")


class ClusterView:
    def __init__(self, registry: Registry):
        self.registry = registry
        self._nodes: dict[str, NodeRecord] = {}
        self._loads: dict[str, NodeLoad] = {}
        self._task: asyncio.Task | None = None
        self._synced = asyncio.Event()
        self.changed = asyncio.Condition()

    async def start(self, wait: float | None = 5.0) -> None:
        """Start watching; waits up to `wait` s for the first snapshot (never fails)."""
        self._task = asyncio.create_task(self._run(), name="cluster-view")
        if wait:
            try:
                await asyncio.wait_for(self._synced.wait(), wait)
            except TimeoutError:
                log.warning("no cluster snapshot within %.1fs; routing waits for discovery",
                            wait)

    async def _run(self) -> None:
        async for ev in self.registry.watch():
            self.apply(ev)
            async with self.changed:
                self.changed.notify_all()

    def apply(self, ev: WatchEvent) -> None:
        if ev.kind == "snapshot":
            self._nodes, self._loads = dict(ev.nodes), dict(ev.loads)
            self._synced.set()
        elif ev.kind == "put" and ev.record is not None:
            self._nodes[ev.key] = ev.record
        elif ev.kind == "delete":
            self._nodes.pop(ev.key, None)
            self._loads.pop(ev.key, None)
            log.info("node %s left the cluster", ev.key)
        elif ev.kind == "load" and ev.load is not None:
            self._loads[ev.key] = ev.load

    def nodes(self, role: str | None = None) -> list[NodeRecord]:
        return [r for r in self._nodes.values() if role is None or r.role == role]

    def load(self, role: str, node_id: str) -> NodeLoad | None:
        return self._loads.get(f"{role}/{node_id}")

    def forget(self, role: str, node_id: str) -> None:
        """Drop a node after failed calls, until discovery announces it again."""
        self._nodes.pop(f"{role}/{node_id}", None)

    async def wait_for(self, predicate, timeout: float) -> bool:
        """Wait until predicate(self) holds (e.g. two decode nodes are known)."""
        async def _wait():
            async with self.changed:
                await self.changed.wait_for(lambda: predicate(self))
        try:
            await asyncio.wait_for(_wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
