"""Least-load: the node with the fewest running + waiting requests (or this router's own
in-flight count, when higher); ties go to more free blocks, then the lower node id."""

from __future__ import annotations

from collections.abc import Sequence

from router.node_pool import NodeState
from router.policies.base import RoutingPolicy, RoutingRequest


def load_key(node: NodeState) -> tuple:
    return (node.load, -node.free_blocks, node.node_id)


class LeastLoadPolicy(RoutingPolicy):
    name = "least-load"

    def pick(self, role: str, nodes: Sequence[NodeState], request: RoutingRequest
             ) -> NodeState:
        return min(nodes, key=load_key)
