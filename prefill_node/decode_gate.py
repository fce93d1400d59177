"""Which decode nodes a prefill node may push KV to.

A Prefill call names the decode node's address; without a check, anyone who can reach a
prefill node could make it dial any host:port (and push model activations there). The gate
answers `allows(address)` before anything is dialed, the abort notice included:

- `DiscoveryDecodeGate(registry)`: the decode nodes registered in discovery right now (a
  `ClusterView` over the registry's watch; unknown until its first snapshot: refused);
- `StaticDecodeGate(addresses)`: a fixed list, for setups without discovery (tests,
  `router/static_pool.py`-style benchmarks);
- `OpenDecodeGate()`: anything (the behaviour before gates existed; a prefill node built
  without a gate uses it and says so at start, once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from cluster.discovery import ClusterView, Registry

log = logging.getLogger("prefill_node")


class DecodeGate:
    def allows(self, address: str) -> bool:
        raise NotImplementedError

    async def admits(self, address: str) -> bool:
        return self.allows(address)

    def describe(self) -> str:
        return type(self).__name__

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


class OpenDecodeGate(DecodeGate):
    def allows(self, address: str) -> bool:
        return True

    def describe(self) -> str:
        return "any address (no decode allow-list configured)"


class StaticDecodeGate(DecodeGate):
    def __init__(self, addresses: Iterable[str]):
        self.addresses = frozenset(a.strip() for a in addresses if a.strip())

    def allows(self, address: str) -> bool:
        return address in self.addresses

    def describe(self) -> str:
        return f"the {len(self.addresses)} listed decode address(es)"


class DiscoveryDecodeGate(DecodeGate):
    """Addresses of the decode nodes in the registry, as the routers see them (a router
    sends the address from the same NodeRecord), and of those that left it less than
    `grace_s` ago: a decode node deregisters first when it drains, yet still takes the
    pushes of the reservations it granted; refusing those would fail their requests. A
    caller still cannot aim the node at a host that never was a decode node."""

    def __init__(self, registry: Registry, close_registry: bool = False,
                 grace_s: float = 120.0):
        """close_registry: the registry is this gate's own (launch builds one for it), so
        close it with the gate."""
        self.view = ClusterView(registry)
        self.close_registry = close_registry
        self.grace_s = grace_s
        self._last_seen: dict[str, float] = {}     # address -> when last registered

    def allows(self, address: str) -> bool:
        now = time.monotonic()
        for r in self.view.nodes("decode"):
            self._last_seen[r.address] = now
        # forget every address gone for longer than the grace, not only the one asked
        # about: decode nodes come back on new ports and IPs, and this would grow forever
        for gone in [a for a, t in self._last_seen.items() if now - t > self.grace_s]:
            del self._last_seen[gone]
        return address in self._last_seen

    async def admits(self, address: str, wait_s: float = 2.0) -> bool:
        """`allows`, waiting up to `wait_s` for this node's discovery watch to catch up
        with a decode node that registered a moment ago (the router may see it first)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not self.allows(address):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def describe(self) -> str:
        return "decode nodes registered in discovery"

    async def start(self) -> None:
        await self.view.start(wait=None)          # never delays the node's start

    async def close(self) -> None:
        await self.view.close()
        if self.close_registry:
            await self.view.registry.close()


async def start_gate(gate: DecodeGate) -> None:
    if isinstance(gate, OpenDecodeGate):
        log.warning("prefill node: no decode allow-list; it pushes KV to any address a "
                    "caller names (give it a DiscoveryDecodeGate or StaticDecodeGate)")
    await gate.start()


__all__ = ["DecodeGate", "DiscoveryDecodeGate", "OpenDecodeGate", "StaticDecodeGate",
           "start_gate"]
