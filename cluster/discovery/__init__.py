"""Discovery: nodes register in etcd (or in memory for tests) and routers watch them.

See cluster/discovery/records.py for the keys and values, registry.py for the interface.
"""

from cluster.discovery.etcd import EtcdRegistry, parse_endpoints
from cluster.discovery.memory import MemoryRegistry, MemoryStore
from cluster.discovery.prefix_digest import PrefixDigest
from cluster.discovery.records import NodeLoad, NodeRecord, new_incarnation
from cluster.discovery.registry import Registry, WatchEvent
from cluster.discovery.view import ClusterView

__all__ = ["ClusterView", "EtcdRegistry", "MemoryRegistry", "MemoryStore", "NodeLoad",
           "NodeRecord", "PrefixDigest", "Registry", "WatchEvent", "new_incarnation",
           "parse_endpoints"]
