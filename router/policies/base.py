"""The policy interface and the request facts a policy may look at."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from engine.prefix_hash import prefix_block_hashes
from router.node_pool import NodeState


class RoutingRequest:
    """The prompt's token ids, with its block hashes computed once per block size."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._hashes: dict[int, list[int]] = {}

    def block_hashes(self, block_size: int) -> list[int]:
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = prefix_block_hashes(self.prompt_token_ids,
                                                                    block_size)
        return hashes


class RoutingPolicy(ABC):
    name = "base"

    @abstractmethod
    def pick(self, role: str, nodes: Sequence[NodeState], request: RoutingRequest
             ) -> NodeState:
        """One of `nodes` (non-empty, sorted by node id) for `request`."""
