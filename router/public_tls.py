"""TLS on the router's public listeners (HTTP and gRPC), for clients outside the cluster.

Separate from the cluster's mutual TLS (cluster/tls.py): public clients are not members of
the cluster and present no certificate; they check the router's certificate (a public CA's,
or one they were given) and authenticate with an API key (router/auth.py). Off by default,
because a router usually sits behind an ingress or load balancer that terminates TLS.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PublicTls:
    cert: str          # PEM: the router's certificate (chain)
    key: str           # PEM: its private key

    @classmethod
    def from_args(cls, cert: str | None, key: str | None) -> PublicTls | None:
        if not cert and not key:
            return None
        if not (cert and key):
            raise ValueError("--public-tls-cert and --public-tls-key go together")
        for path in (cert, key):
            if not Path(path).is_file():
                raise ValueError(f"public TLS file {path!r} does not exist")
        return cls(cert, key)

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def grpc_credentials(self):
        import grpc

        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())])
