"""The router's view of the cluster: live nodes by role, their published load and prefix
block hashes, and this router's own in-flight count per node.

Fed by the discovery watch (PUT adds or updates, DELETE removes). A node whose call fails is
dropped at once (`mark_failed`) rather than waiting for its lease to expire. It comes back
when discovery announces a new incarnation (a restart), or, if discovery still lists it
after `failed_hold_s` (longer than a lease TTL, so a dead node's DELETE normally comes
first), when that hold ends: the fault was transient.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from cluster.discovery.prefix_digest import PrefixDigest


@dataclass
class NodeState:
    node_id: str
    role: str                       # "prefill" | "decode"
    address: str                    # host:port of its gRPC server
    model: str = ""
    incarnation: str = ""
    block_size: int = 16
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    # the prefix blocks it holds: exact, or a Bloom filter as etcd carries them
    block_hashes: frozenset[int] | PrefixDigest = field(default_factory=frozenset)
    inflight: int = 0               # requests this router has on the node right now
    kernel_error: str = ""          # its C++ CPU kernels did not build (/health says so)

    @property
    def load(self) -> int:
        # Published figures lag by the publish interval; this router's own in-flight count
        # does not, so a burst from one router still spreads.
        return max(self.running + self.waiting, self.inflight)


class NodePool:
    def __init__(self, failed_hold_s: float = 10.0):
        self._nodes: dict[str, NodeState] = {}
        self._failed: dict[str, tuple[NodeState, float]] = {}   # node_id -> (state, when)
        self.failed_hold_s = failed_hold_s
        self.version = 0            # bumped on membership change (tests wait on it)
        self._removed: dict[str, asyncio.Event] = {}   # set when discovery drops the node
        self._change_waiters: list[asyncio.Future] = []

    # ---- discovery events ------------------------------------------------------------
    def upsert(self, node: NodeState) -> None:
        failed = self._failed.get(node.node_id)
        if failed is not None:
            state, when = failed
            if node.incarnation == state.incarnation:
                self._failed[node.node_id] = (node, when)    # same process: stay on hold
                return
            del self._failed[node.node_id]                  # restarted: take it now
        old = self._nodes.get(node.node_id)
        if old is not None and old.incarnation == node.incarnation:
            # A re-put of the same process: keep the load it published and our count.
            for attr in ("running", "waiting", "free_blocks", "total_blocks", "block_hashes",
                         "inflight"):
                setattr(node, attr, getattr(old, attr))
        if old is None or old.address != node.address or old.incarnation != node.incarnation:
            self._bump()
        self._nodes[node.node_id] = node

    def update_load(self, node_id: str, *, running: int | None = None,
                    waiting: int | None = None, free_blocks: int | None = None,
                    total_blocks: int | None = None,
                    block_hashes: frozenset[int] | PrefixDigest | None = None) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            return
        if running is not None:
            node.running = running
        if waiting is not None:
            node.waiting = waiting
        if free_blocks is not None:
            node.free_blocks = free_blocks
        if total_blocks is not None:
            node.total_blocks = total_blocks
        if block_hashes is not None:
            node.block_hashes = block_hashes

    def remove(self, node_id: str) -> None:
        """Discovery says the node is gone (DELETE): forget it, on hold or not."""
        self._failed.pop(node_id, None)
        if self._nodes.pop(node_id, None) is not None:
            self._bump()
        event = self._removed.pop(node_id, None)
        if event is not None:
            event.set()

    def removal(self, node_id: str) -> asyncio.Event:
        """Set when discovery next drops `node_id` (its lease ran out, or it deregistered):
        a request waiting on the node's work need not wait for its own timeouts."""
        event = self._removed.get(node_id)
        if event is None:
            event = self._removed[node_id] = asyncio.Event()
        return event

    def mark_failed(self, node_id: str) -> None:
        node = self._nodes.pop(node_id, None)
        if node is not None:
            self._failed[node_id] = (node, time.monotonic())
            self._bump()

    def _revive(self) -> None:
        now = time.monotonic()
        for node_id, (state, when) in list(self._failed.items()):
            if now - when >= self.failed_hold_s:
                del self._failed[node_id]
                self._nodes[node_id] = state
                self._bump()

    def _bump(self) -> None:
        self.version += 1
        waiters, self._change_waiters = self._change_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_change(self, timeout: float) -> bool:
        """Wait until membership changes (a node joins, comes back or leaves); False when
        `timeout` passed first. A failed node's hold ending is seen by the next query,
        not here: callers poll with a bounded timeout."""
        fut = asyncio.get_running_loop().create_future()
        self._change_waiters.append(fut)
        try:
            await asyncio.wait_for(fut, max(0.0, timeout))
            return True
        except TimeoutError:
            return False
        finally:
            if fut in self._change_waiters:
                self._change_waiters.remove(fut)

    # ---- queries ---------------------------------------------------------------------
    def nodes(self, role: str, model: str | None = None) -> list[NodeState]:
        """Live nodes of a role, sorted by node id (policies depend on a stable order)."""
        if self._failed:
            self._revive()
        out = [n for n in self._nodes.values()
               if n.role == role and (model is None or not n.model or n.model == model)]
        return sorted(out, key=lambda n: n.node_id)

    def get(self, node_id: str) -> NodeState | None:
        return self._nodes.get(node_id)

    def all(self) -> list[NodeState]:
        if self._failed:
            self._revive()
        return sorted(self._nodes.values(), key=lambda n: (n.role, n.node_id))
