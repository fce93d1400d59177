"""What a node publishes in discovery, and where (etcd keys / in-memory keys).

/pdserve/<cluster>/nodes/<role>/<node_id> = NodeRecord (JSON), bound to the node's lease:
    who the node is and where to dial it; the key's existence is the liveness signal.
/pdserve/<cluster>/load/<role>/<node_id>  = NodeLoad (JSON), same lease, rewritten only
    when it changed and at most once per EtcdRegistry.min_load_interval (etcd keeps every
    revision until compaction, so an idle node must not write); its prefix-block hashes
    travel as a PrefixDigest (a Bloom filter, ~5 KB at most) rather than a list.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace

from cluster.discovery.prefix_digest import PrefixDigest

# "aggregated": a node that prefills and decodes by itself (no KV push), routed as one unit.
ROLES = ("prefill", "decode", "aggregated")


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
    role: str                   # one of ROLES
    address: str                # host:port other nodes and routers dial
    incarnation: str
    model_id: str = ""
    max_model_len: int = 0
    fingerprint: dict = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    # why the node's C++ CPU kernels could not be built ("" when they were, or when it
    # needs none): it serves through the slower torch path; the router's /health says so
    kernel_error: str = ""

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
        """Fields this version does not know are ignored: a node of a newer version (a
        rolling update) still registers with an older router."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


@dataclass(frozen=True)
class NodeLoad:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    reserved: int = 0           # decode: reservations waiting for their KV push
    # The full prefix blocks held: on the node, their chained hashes
    # (engine.prefix_hash.chain_hash); read back from etcd, a PrefixDigest of them. Both
    # answer `h in block_hashes`, which is all the router asks.
    block_hashes: tuple[int, ...] | PrefixDigest = ()
    incarnation: str = ""
    ts: float = field(default_factory=time.time)     # when measured (not a heartbeat)

    def same_as(self, other: NodeLoad | None) -> bool:
        """Equal but for the time of measurement: nothing worth a new etcd revision."""
        return other is not None and replace(self, ts=0.0) == replace(other, ts=0.0)

    def to_json(self) -> bytes:
        d = asdict(self)
        hashes = d.pop("block_hashes")
        digest = hashes if isinstance(hashes, PrefixDigest) else PrefixDigest.of(hashes)
        d["prefix_digest"] = digest.to_dict()
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeLoad:
        d = json.loads(raw)
        if "prefix_digest" in d:
            d["block_hashes"] = PrefixDigest.from_dict(d.pop("prefix_digest"))
        else:   # a node from before the digest: the plain list
            d["block_hashes"] = tuple(d.get("block_hashes", ()))
        return cls(**d)
