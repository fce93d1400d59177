"""API keys for the router's public edge (`--api-key` / PDSERVE_API_KEY).

A client sends `Authorization: Bearer <key>` (HTTP) or the metadata `authorization: Bearer
<key>` (gRPC). The comparison runs in constant time against every configured key, so the
answer's timing says neither how much of a guess was right nor which key it was close to.
No keys configured means an open router (the default, as before).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

# Probes and health checks stay open: Kubernetes cannot send a key.
OPEN_HTTP_PATHS = frozenset({"/health"})
OPEN_GRPC_SERVICES = frozenset({"grpc.health.v1.Health"})


def split_keys(values: Iterable[str]) -> list[str]:
    """Flag values / env text -> keys: each value may hold several, comma-separated."""
    return [k.strip() for v in values for k in v.split(",") if k.strip()]


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()):
        keys = split_keys(keys)
        for key in keys:
            # Keys travel in HTTP headers and gRPC metadata: visible ASCII only.
            if not all(0x21 <= ord(c) <= 0x7E for c in key):
                raise ValueError("an API key must be visible ASCII characters (no spaces, "
                                 "no control characters)")
        self._keys = tuple(k.encode("ascii") for k in keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:                   # never the keys themselves
        return f"ApiKeys({len(self._keys)} key(s))"

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` value carries one of the keys (always, when none are
        configured)."""
        return not self._keys or self.match(authorization) is not None

    def match(self, authorization: str | None) -> int | None:
        """The index of the key an `Authorization` value carries (which rate-limit bucket
        it draws from), None for none or no keys configured."""
        if not self._keys or not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        given = token.strip().encode("utf-8", "replace")
        found = None
        for index, key in enumerate(self._keys):     # all of them, whatever matched first
            if hmac.compare_digest(given, key):
                found = index
        return found if scheme.lower() == "bearer" else None


UNAUTHENTICATED_MESSAGE = ("a valid API key is required: send it as `Authorization: Bearer "
                           "<key>`")
