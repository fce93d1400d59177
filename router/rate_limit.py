"""Per-API-key rate limits at the router's edge (`--rate-limit RPS[:BURST]`).

One token bucket per configured key: it holds at most BURST tokens, refills at RPS tokens
a second, and every call made with that key takes one (HTTP requests and gRPC calls alike,
whatever they ask for; `/health`, `/metrics` and gRPC health take none). An empty bucket
answers 429 with `Retry-After` (HTTP) or RESOURCE_EXHAUSTED with a `retry-after` trailer
(gRPC), before the body is read. Keys never share a bucket, and only configured keys have
one (a call is authenticated first), so the table cannot grow with what clients send.

The buckets live in one router process: N routers behind a load balancer let a key through
up to N times the rate. Both fronts run on the router's one event loop, so the buckets
need no lock.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimit:
    rate: float             # tokens (calls) per second
    burst: int              # the bucket's size: calls allowed at once after a quiet spell

    def __post_init__(self):
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate limit: RPS must be a number > 0, got {self.rate}")
        if self.burst < 1:
            raise ValueError(f"rate limit: BURST must be an integer >= 1, got {self.burst}")

    @classmethod
    def parse(cls, spec: str) -> RateLimit:
        """'RPS' or 'RPS:BURST' (BURST defaults to RPS rounded up: one second's worth)."""
        rps, sep, burst = str(spec).strip().partition(":")
        try:
            rate = float(rps)
            size = int(burst) if sep else None
        except ValueError:
            raise ValueError(f"--rate-limit must be RPS or RPS:BURST (e.g. 5 or 0.5:3), got "
                             f"{spec!r}") from None
        if size is None:        # a bad rate gets 1 here and is refused by __post_init__
            size = max(1, math.ceil(rate)) if math.isfinite(rate) else 1
        return cls(rate, size)

    def __str__(self) -> str:
        return f"{self.rate:g}/s, burst {self.burst}"


class RateLimiter:
    """Buckets by key index (ApiKeys.match); `take` says how long to wait, 0 when allowed."""

    def __init__(self, limit: RateLimit, clock=time.monotonic):
        self.limit = limit
        self.clock = clock
        self._buckets: dict[int, tuple[float, float]] = {}    # key -> (tokens, as of time)
        self.refused = 0

    def take(self, key: int) -> float:
        now = self.clock()
        tokens, since = self._buckets.get(key, (float(self.limit.burst), now))
        tokens = min(float(self.limit.burst), tokens + (now - since) * self.limit.rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        self.refused += 1
        return (1.0 - tokens) / self.limit.rate

    def message(self, wait_s: float) -> str:
        return (f"rate limit exceeded for this API key ({self.limit}); retry in "
                f"{retry_after_s(wait_s)} s")


def retry_after_s(wait_s: float) -> int:
    """Whole seconds for Retry-After (at least 1: 0 would invite an immediate retry)."""
    return max(1, math.ceil(wait_s))


__all__ = ["RateLimit", "RateLimiter", "retry_after_s"]
