"""A compact, fixed-cost stand-in for the set of prefix-block hashes a node publishes.

The load record used to carry every cached block hash as a JSON list of 64-bit ints (up to
4096 of them, ~62-88 KB per write). etcd keeps every revision of a key until compaction, so
that record dominated the database. The router only asks "does this node hold block h?"
(router/policies/prefix_aware.py), which a Bloom filter answers in ~10 bits per hash:
4096 hashes fit in 5 KB (6.8 KB as base64), with no false negatives and about 1% false
positives. A false positive can only lengthen a node's claimed prefix match by a block or
so (the match walks the chain and stops at the first miss), i.e. a slightly worse routing
choice, never a wrong answer: the node checks the actual tokens on a cache hit.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable

BITS_PER_HASH = 10      # with K_HASHES = 7: ~0.8% false positives at full load
K_HASHES = 7
MIN_BITS = 512          # small caches still get a filter with few collisions
_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: the chain hashes are Python tuple hashes, whose low bits are
    not guaranteed to be uniform, so spread them before taking indices."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _indices(h: int, k: int, m: int) -> list[int]:
    # Kirsch-Mitzenmacher double hashing: k indices from two 32-bit halves of one mix
    x = _mix(h & _MASK64)
    a, b = x & 0xFFFFFFFF, (x >> 32) | 1
    return [(a + i * b) % m for i in range(k)]


class PrefixDigest:
    """A Bloom filter over chained block hashes: `h in digest`, `len(digest)` (hashes
    added), falsy when empty. Equal digests have equal bytes (same inputs, same bits)."""

    __slots__ = ("bits", "count", "k", "m")

    def __init__(self, m: int, k: int = K_HASHES, bits: bytes | None = None, count: int = 0):
        if m <= 0 or m % 8 or k <= 0:
            raise ValueError(f"bad digest shape: m={m} bits (a positive multiple of 8), k={k}")
        self.m, self.k, self.count = m, k, count
        self.bits = bytearray(bits) if bits is not None else bytearray(m // 8)
        if len(self.bits) != m // 8:
            raise ValueError(f"digest has {len(self.bits)} bytes, expected {m // 8}")

    @classmethod
    def of(cls, hashes: Iterable[int]) -> PrefixDigest:
        unique = set(hashes)
        # round up to whole 512-bit lines so small changes in count keep the same shape
        m = max(MIN_BITS, math.ceil(len(unique) * BITS_PER_HASH / 512) * 512)
        digest = cls(m)
        bits, k = digest.bits, digest.k
        for h in unique:    # the node's event loop runs this: kept to plain int arithmetic
            x = _mix(h & _MASK64)
            a, b = x & 0xFFFFFFFF, (x >> 32) | 1
            for i in range(k):
                j = (a + i * b) % m
                bits[j >> 3] |= 1 << (j & 7)
        digest.count = len(unique)
        return digest

    def __contains__(self, h: object) -> bool:
        if not isinstance(h, int) or not self.count:
            return False
        return all(self.bits[i >> 3] & (1 << (i & 7)) for i in _indices(h, self.k, self.m))

    def __len__(self) -> int:
        return self.count

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PrefixDigest) and (self.m, self.k, self.count, self.bits)
                == (other.m, other.k, other.count, other.bits))

    def __hash__(self) -> int:
        return hash((self.m, self.k, self.count, bytes(self.bits)))

    def __repr__(self) -> str:
        return f"PrefixDigest({self.count} hashes, {self.m // 8} bytes)"

    def to_dict(self) -> dict:
        return {"m": self.m, "k": self.k, "n": self.count,
                "bits": base64.b64encode(bytes(self.bits)).decode()}

    @classmethod
    def from_dict(cls, d: dict) -> PrefixDigest:
        return cls(int(d["m"]), int(d["k"]), base64.b64decode(d["bits"]), int(d["n"]))
