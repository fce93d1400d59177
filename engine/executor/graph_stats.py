"""Counters of the graph executor, in the shape `LLMEngine.stats()` reports them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    fallbacks: Counter = field(default_factory=Counter)   # reason -> eager steps

    def as_dict(self) -> dict:
        return {"graph_captures": self.captures, "graph_replays": self.replays,
                "graph_fallbacks": dict(self.fallbacks)}


def executor_stats(executor) -> dict:
    """The graph counters of any executor (zeros for one that never uses graphs)."""
    stats = getattr(executor, "graph_stats", None)
    return (stats if isinstance(stats, GraphStats) else GraphStats()).as_dict()
