"""Prefix-cache-aware: the node that already holds the longest prefix of the prompt's
blocks (by the chained block hashes nodes publish), among nodes not much busier than the
least-loaded one; ties and no-hit requests fall back to least-load.

The load bound keeps one hot prefix (a shared system prompt) from piling every request onto
one node: a node may be chosen for its cache only while its load is within
`max_load_gap` of the least-loaded node's.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.node_pool import NodeState
from router.policies.base import RoutingPolicy, RoutingRequest
from router.policies.least_load import load_key


def matched_blocks(node: NodeState, request: RoutingRequest) -> int:
    """Leading prompt blocks the node holds (a chain: a miss ends the match)."""
    if not node.block_hashes:
        return 0
    n = 0
    for h in request.block_hashes(node.block_size):
        if h not in node.block_hashes:
            break
        n += 1
    return n


class PrefixCacheAwarePolicy(RoutingPolicy):
    name = "prefix-cache-aware"

    def __init__(self, max_load_gap: int = 4) -> None:
        if max_load_gap < 0:
            raise ValueError(f"max_load_gap must be >= 0, got {max_load_gap}")
        self.max_load_gap = max_load_gap

    def pick(self, role: str, nodes: Sequence[NodeState], request: RoutingRequest
             ) -> NodeState:
        least = min(n.load for n in nodes)
        eligible = [n for n in nodes if n.load <= least + self.max_load_gap]
        return min(eligible, key=lambda n: (-matched_blocks(n, request),) + load_key(n))
