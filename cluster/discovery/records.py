"""What a node publishes in discovery, and where (etcd keys / in-memory keys).

/pdserve/<cluster>/nodes/<role>/<node_id> = NodeRecord (JSON), bound to the node's lease:
    who the node is and where to dial it; the key's existence is the liveness signal.
/pdserve/<cluster>/load/<role>/<node_id>  = NodeLoad (JSON), same lease, rewritten often.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field

ROLES = ("prefill", "decode")


def cluster_prefix(cluster: str) -> str:
    if not cluster or "/" in cluster:
        raise ValueError(f"cluster name must be non-empty and without '/', got {cluster!r}")
    return f"/pdserve/{cluster}/"


def node_key(cluster: str, role: str, node_id: str) -> str:
    return f"{cluster_prefix(cluster)}nodes/{role}/{node_id}"


def load_key(cluster: str, role: str, node_id: str) -> str:
    return f"{cluster_prefix(cluster)}load/{role}/{node_id}"


def parse_key(cluster: str, key: str) -> tuple[str, str, str] | None:
    """'/pdserve/c/nodes/decode/n1' -> ('nodes', 'decode', 'n1'); None for foreign keys."""
    prefix = cluster_prefix(cluster)
    if not key.startswith(prefix):
        return None
    parts = key[len(prefix):].split("/")
    if len(parts) != 3 or parts[0] not in ("nodes", "load") or parts[1] not in ROLES:
        return None
    return parts[0], parts[1], parts[2]


def new_incarnation() -> str:
    """Distinguishes a restarted node (same node_id) from its previous life."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    role: str                   # "prefill" | "decode"
    address: str                # host:port other nodes and routers dial
    incarnation: str
    model_id: str = ""
    max_model_len: int = 0
    fingerprint: dict = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.node_id or "/" in self.node_id:
            raise ValueError(f"node_id must be non-empty and without '/', got {self.node_id!r}")

    @property
    def key(self) -> str:
        return f"{self.role}/{self.node_id}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeRecord:
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class NodeLoad:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    reserved: int = 0           # decode: reservations waiting for their KV push
    # Chained hashes (engine.block_manager.chain_hash) of the full prefix blocks held.
    block_hashes: tuple[int, ...] = ()
    incarnation: str = ""
    ts: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        d = asdict(self)
        d["block_hashes"] = list(self.block_hashes)
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeLoad:
        d = json.loads(raw)
        d["block_hashes"] = tuple(d.get("block_hashes", ()))
        return cls(**d)
