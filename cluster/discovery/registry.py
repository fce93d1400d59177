"""The discovery interface shared by the etcd registry and the in-memory one.

A node process owns one registry: `register(record)` once (the registry keeps the lease
alive and re-registers after an outage by itself), `publish_load(load)` often,
`deregister()` on drain. A router watches: `watch()` yields a "snapshot" event first, then
"put" / "delete" (node keys) and "load" events; after an outage the watch resumes with a
fresh "snapshot" that replaces everything known before.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cluster.discovery.records import NodeLoad, NodeRecord


@dataclass
class WatchEvent:
    kind: str                               # snapshot | put | delete | load
    role: str = ""
    node_id: str = ""
    record: NodeRecord | None = None        # put
    load: NodeLoad | None = None            # load
    nodes: dict[str, NodeRecord] = field(default_factory=dict)   # snapshot: key -> record
    loads: dict[str, NodeLoad] = field(default_factory=dict)     # snapshot: key -> load

    @property
    def key(self) -> str:
        return f"{self.role}/{self.node_id}"


class Registry(abc.ABC):
    def __init__(self, cluster: str):
        from cluster.discovery.records import cluster_prefix

        cluster_prefix(cluster)   # validates the name
        self.cluster = cluster

    @abc.abstractmethod
    async def register(self, record: NodeRecord) -> None: ...

    @abc.abstractmethod
    async def publish_load(self, load: NodeLoad) -> None: ...

    @abc.abstractmethod
    async def deregister(self) -> None: ...

    @abc.abstractmethod
    async def snapshot(self) -> tuple[dict[str, NodeRecord], dict[str, NodeLoad]]: ...

    @abc.abstractmethod
    def watch(self) -> AsyncIterator[WatchEvent]: ...

    @property
    @abc.abstractmethod
    def registered(self) -> bool:
        """True while this registry's node is known to be registered in the backend."""

    async def close(self) -> None:
        """Stop background work and release connections (does not deregister)."""
        return None
