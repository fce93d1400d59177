"""How a process reaches etcd: TLS files and etcd's own user/password (`EtcdAccess`), and
errors that name the flag to fix (`describe_etcd_error`). The client itself is
cluster/discovery/etcd_client.py; this module imports no aetcd, so the CLI and configs can
use it cheaply.

etcd's two client credentials, either or both:
- a client certificate (etcd `--client-cert-auth`): the handshake fails without one signed
  by etcd's `--trusted-ca-file`; with etcd auth enabled and no password given, etcd takes
  the certificate's common name as the user;
- user/password (etcd `auth enable`): aetcd trades them for a token at connect; over a
  plaintext link the password would cross the network in clear, so that is warned about.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class EtcdAccess:
    """TLS files (PEM) and credentials for etcd; all empty: plaintext, no auth.

    ca: the CA bundle etcd's server certificate must chain to (without it, but with TLS on,
    the system's roots); cert/key: this process's client certificate, together;
    user/password: together. `tls` is also turned on by an `https://` endpoint."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise ValueError("etcd client TLS needs --etcd-cert and --etcd-key together")
        if bool(self.user) != bool(self.password):
            raise ValueError("etcd authentication needs both a user (--etcd-user) and a "
                             "password (--etcd-password / PDSERVE_ETCD_PASSWORD)")
        for flag, path in (("--etcd-ca", self.ca), ("--etcd-cert", self.cert),
                           ("--etcd-key", self.key)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if self.ca or self.cert:
            object.__setattr__(self, "tls", True)

    def channel_credentials(self):
        """Read the files now: a process restarted after rotation gets the new ones."""
        import grpc

        read = (lambda p: Path(p).read_bytes() if p else None)
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca),
                                            private_key=read(self.key),
                                            certificate_chain=read(self.cert))


def describe_etcd_error(exc: BaseException, where: str, access: EtcdAccess | None) -> str:
    """One sentence for a failed etcd call, naming the likely fix for handshake and
    credential failures; other errors as `Type: message`."""
    text = str(exc)
    tls = access is not None and access.tls
    if type(exc).__name__ == "UnauthenticatedError" or "authentication failed" \
            in text or "user name is empty" in text:
        return (f"etcd {where} refused the credentials ({text}); check --etcd-user and "
                f"--etcd-password [PDSERVE_ETCD_PASSWORD]")
    if not tls and "Socket closed" in text:
        return (f"etcd {where} closed the connection during the handshake; it probably "
                f"serves TLS: give --etcd-ca (and --etcd-cert/--etcd-key if it requires "
                f"client certificates) ({text})")
    if tls and ("BAD_CERTIFICATE" in text or "CERTIFICATE_REQUIRED" in text):
        return (f"etcd {where} refused this process's client certificate: give "
                f"--etcd-cert/--etcd-key signed by the CA etcd trusts "
                f"(--trusted-ca-file) ({text})")
    if tls and ("CERTIFICATE_VERIFY_FAILED" in text or "Peer name" in text
                or "WRONG_VERSION_NUMBER" in text or "handshake" in text.lower()):
        return (f"TLS to etcd {where} failed: its certificate must chain to --etcd-ca and "
                f"name the host dialed, and it must serve TLS ({text})")
    return f"etcd {where}: {type(exc).__name__}: {text}"


__all__ = ["EtcdAccess", "describe_etcd_error"]
