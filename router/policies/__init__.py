"""Routing policies, chosen by name (`--policy`). A policy picks one node of a role for a
request; the PD backend asks it once for a prefill node and once for a decode node.

Registry of lazy imports: name -> "module:Class".
"""

from __future__ import annotations

import importlib

from router.policies.base import RoutingPolicy, RoutingRequest

POLICIES: dict[str, str] = {
    "round-robin": "router.policies.round_robin:RoundRobinPolicy",
    "least-load": "router.policies.least_load:LeastLoadPolicy",
    "prefix-cache-aware": "router.policies.prefix_aware:PrefixCacheAwarePolicy",
}

DEFAULT_POLICY = "prefix-cache-aware"


def make_policy(name: str, **options) -> RoutingPolicy:
    entry = POLICIES.get(name)
    if entry is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of "
                         f"{', '.join(sorted(POLICIES))}")
    module_name, _, cls_name = entry.partition(":")
    return getattr(importlib.import_module(module_name), cls_name)(**options)


__all__ = ["POLICIES", "DEFAULT_POLICY", "RoutingPolicy", "RoutingRequest", "make_policy"]
