"""Resource limits of the decode node's raw-TCP KV data plane (tcp_transport.TcpKvServer).

The data plane listens on a port reachable by whoever reaches the node, before any
credential is shown (the push token travels in the first frame), so every connection must
cost a bounded amount: at most `max_connections` are served at once (each on one thread
of a fixed pool; more are refused at once with a RESOURCE_EXHAUSTED greeting, and the
prefill side then pushes over gRPC), a new connection must deliver its header within
`header_timeout_s`, and after that every frame must arrive within `idle_timeout_s`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TcpLimits:
    max_connections: int = 64        # pushes served at once (= reader threads at most)
    header_timeout_s: float = 5.0    # connect -> the whole header frame
    idle_timeout_s: float = 30.0     # each later frame, from the end of the previous one

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("header_timeout_s", "idle_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
