"""A router backend over fixed node addresses, without discovery.

`static_pool` fills a `NodePool` with one `NodeState` per address (ids `prefill-0`,
`decode-0`, ...), as the discovery feed would from etcd; `static_backend` puts the router's
own `PdBackend` on top. Tests and benchmarks use it to drive nodes they started themselves
through exactly the PD flow a router runs (reservation, prefill, token stream, failures).
"""

from __future__ import annotations

from collections.abc import Iterable

from router.metrics import RouterMetrics
from router.node_pool import NodePool, NodeState
from router.pd_backend import PdBackend
from router.policies import make_policy

STATIC_INCARNATION = "static"


def static_pool(prefill: Iterable[str], decode: Iterable[str], *, model: str = "",
                block_size: int = 16) -> NodePool:
    """A pool holding the given prefill and decode addresses (host:port)."""
    pool = NodePool()
    for role, addresses in (("prefill", prefill), ("decode", decode)):
        for i, address in enumerate(addresses):
            pool.upsert(NodeState(node_id=f"{role}-{i}", role=role, address=address,
                                  model=model, incarnation=STATIC_INCARNATION,
                                  block_size=block_size))
    return pool


def static_backend(prefill: Iterable[str], decode: Iterable[str], *, max_model_len: int,
                   policy: str = "round-robin", **options) -> PdBackend:
    """The router's PdBackend over `static_pool(prefill, decode)`; `options` go to
    PdBackend (lease_ms, max_attempts, stall_timeout_s). Close it with `await .close()`."""
    pool = static_pool(prefill, decode)
    return PdBackend(pool, make_policy(policy), RouterMetrics(pool),
                     max_model_len=max_model_len, **options)
