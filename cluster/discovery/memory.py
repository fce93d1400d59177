"""In-memory registry with the etcd registry's interface, for unit tests and one-process use.

Registries sharing one MemoryStore see each other, as processes sharing one etcd do.
`MemoryStore.expire(role, node_id)` plays a lease running out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from cluster.discovery.records import NodeLoad, NodeRecord
from cluster.discovery.registry import Registry, WatchEvent


class MemoryStore:
    def __init__(self) -> None:
        # cluster -> "role/node_id" -> value
        self.nodes: dict[str, dict[str, NodeRecord]] = {}
        self.loads: dict[str, dict[str, NodeLoad]] = {}
        self._subscribers: dict[str, list[asyncio.Queue]] = {}

    def _nodes(self, cluster: str) -> dict[str, NodeRecord]:
        return self.nodes.setdefault(cluster, {})

    def _loads(self, cluster: str) -> dict[str, NodeLoad]:
        return self.loads.setdefault(cluster, {})

    def _emit(self, cluster: str, event: WatchEvent) -> None:
        for q in self._subscribers.get(cluster, []):
            q.put_nowait(event)

    def put_node(self, cluster: str, record: NodeRecord) -> None:
        self._nodes(cluster)[record.key] = record
        self._emit(cluster, WatchEvent("put", record.role, record.node_id, record=record))

    def put_load(self, cluster: str, role: str, node_id: str, load: NodeLoad) -> None:
        key = f"{role}/{node_id}"
        if key not in self._nodes(cluster):
            return      # as with etcd: load keys live on the node's lease
        self._loads(cluster)[key] = load
        self._emit(cluster, WatchEvent("load", role, node_id, load=load))

    def expire(self, cluster: str, role: str, node_id: str) -> None:
        key = f"{role}/{node_id}"
        self._loads(cluster).pop(key, None)
        if self._nodes(cluster).pop(key, None) is not None:
            self._emit(cluster, WatchEvent("delete", role, node_id))

    def subscribe(self, cluster: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(WatchEvent("snapshot", nodes=dict(self._nodes(cluster)),
                                loads=dict(self._loads(cluster))))
        self._subscribers.setdefault(cluster, []).append(q)
        return q

    def unsubscribe(self, cluster: str, q: asyncio.Queue) -> None:
        subs = self._subscribers.get(cluster, [])
        if q in subs:
            subs.remove(q)


class MemoryRegistry(Registry):
    def __init__(self, cluster: str = "default", store: MemoryStore | None = None):
        super().__init__(cluster)
        self.store = store if store is not None else MemoryStore()
        self._record: NodeRecord | None = None

    @property
    def registered(self) -> bool:
        return self._record is not None and self._record.key in self.store._nodes(self.cluster)

    async def register(self, record: NodeRecord) -> None:
        self._record = record
        self.store.put_node(self.cluster, record)

    async def publish_load(self, load: NodeLoad) -> None:
        if self._record is not None:
            self.store.put_load(self.cluster, self._record.role, self._record.node_id, load)

    async def deregister(self) -> None:
        if self._record is not None:
            self.store.expire(self.cluster, self._record.role, self._record.node_id)
            self._record = None

    async def snapshot(self) -> tuple[dict[str, NodeRecord], dict[str, NodeLoad]]:
        return dict(self.store._nodes(self.cluster)), dict(self.store._loads(self.cluster))

    async def watch(self) -> AsyncIterator[WatchEvent]:
        q = self.store.subscribe(self.cluster)
        try:
            while True:
                yield await q.get()
        finally:
            self.store.unsubscribe(self.cluster, q)
