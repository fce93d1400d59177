"""Round-robin: each role's nodes in node-id order, one after the other."""

from __future__ import annotations

from collections.abc import Sequence

from router.node_pool import NodeState
from router.policies.base import RoutingPolicy, RoutingRequest


class RoundRobinPolicy(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, role: str, nodes: Sequence[NodeState], request: RoutingRequest
             ) -> NodeState:
        i = self._next.get(role, 0)
        self._next[role] = i + 1
        return nodes[i % len(nodes)]
