"""Mutual TLS between the processes of one cluster, all certificates from one cluster CA.

Who may talk to whom is decided by the CA alone: every node gRPC server and the decode
node's raw-TCP KV data plane demand a client certificate signed by the cluster CA, and
every client (router -> nodes, prefill -> decode) checks that the server's certificate is
signed by it too. A peer without such a certificate never gets past the handshake, so it
never reaches a handler (push tokens, reservations) at all.

Names: pod IPs change with every restart and node addresses come from discovery, so
certificates would have to be issued per pod to carry their IP. Instead every leaf carries
one fixed DNS name, CLUSTER_NAME (plus localhost / 127.0.0.1 / ::1 and any hosts asked
for), and clients check that name whatever address they dial: gRPC through
`grpc.ssl_target_name_override`, the data plane through `server_hostname`. The identity
checked is "a member of this cluster", which is what the CA vouches for; keep the CA key
off the serving machines so nobody there can mint more members.

Certificates are made with `cryptography` (`make_ca`, `make_leaf`, `write_cluster_certs`):
`pdserve up` makes a throw-away CA per run, `pdserve certs` makes files for a deployment.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CLUSTER_NAME = "pdserve.cluster.internal"
DEFAULT_DAYS = 365


@dataclass(frozen=True)
class TlsConfig:
    """One process's view: the CA bundle it trusts, its own certificate chain and key (PEM
    files; several CA certificates in `ca` are all trusted, for rotation)."""

    ca: str
    cert: str
    key: str

    @classmethod
    def from_args(cls, ca: str | None, cert: str | None,
                  key: str | None) -> TlsConfig | None:
        """All three paths, or none (None: plaintext); ValueError names what is missing."""
        given = {"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key}
        if not any(given.values()):
            return None
        missing = [flag for flag, v in given.items() if not v]
        if missing:
            raise ValueError(f"TLS needs --tls-ca, --tls-cert and --tls-key together; "
                             f"missing {', '.join(missing)}")
        for flag, path in given.items():
            if not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        return cls(ca=str(ca), cert=str(cert), key=str(key))

    def _read(self) -> tuple[bytes, bytes, bytes]:
        # read on every call: a process restarted after rotation picks up the new files
        return (Path(self.ca).read_bytes(), Path(self.cert).read_bytes(),
                Path(self.key).read_bytes())

    # ---- gRPC ------------------------------------------------------------------------
    def grpc_server_credentials(self):
        import grpc

        ca, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def grpc_channel_credentials(self):
        import grpc

        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    @staticmethod
    def grpc_channel_options() -> list[tuple[str, str]]:
        """The name checked in the server's certificate, whatever address is dialed."""
        return [("grpc.ssl_target_name_override", CLUSTER_NAME)]

    # ---- raw sockets (the KV data plane) ---------------------------------------------
    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(cafile=self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED           # no client certificate: no connection
        # No session tickets: the sender reads the verdict on one thread while writing on
        # another; with no post-handshake messages from the server, its reads never
        # touch the write state of the connection.
        ctx.num_tickets = 0
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # verifies chain and hostname
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(cafile=self.ca)
        return ctx

    def wrap_client(self, sock, context: ssl.SSLContext | None = None) -> ssl.SSLSocket:
        """Handshake as a client; the server must prove CLUSTER_NAME under the CA."""
        return (context or self.client_context()).wrap_socket(sock,
                                                              server_hostname=CLUSTER_NAME)


# ---- making certificates --------------------------------------------------------------
def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())      # fast to make, fast handshakes


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder, days: int):
    now = datetime.datetime.now(datetime.UTC)
    # a minute back: clocks of the machines in one cluster are never exactly equal
    return builder.not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(
        now + datetime.timedelta(days=days))


def make_ca(common_name: str = "pdserve cluster CA",
            days: int = DEFAULT_DAYS) -> tuple[bytes, bytes]:
    """A self-signed CA: (certificate PEM, key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _new_key()
    builder = (x509.CertificateBuilder().subject_name(_name(common_name))
               .issuer_name(_name(common_name)).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                            crl_sign=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False))
    cert = _validity(builder, days).sign(key, hashes.SHA256())
    from cryptography.hazmat.primitives import serialization
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def make_leaf(ca_cert_pem: bytes, ca_key_pem: bytes, common_name: str,
              hosts: Iterable[str] = (), days: int = DEFAULT_DAYS) -> tuple[bytes, bytes]:
    """A certificate for one process, both server and client (every node is both):
    SANs CLUSTER_NAME, localhost, 127.0.0.1, ::1 and `hosts` (names or IPs)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = _new_key()
    sans: list[x509.GeneralName] = [x509.DNSName(CLUSTER_NAME), x509.DNSName("localhost")]
    for host in ["127.0.0.1", "::1", *hosts]:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            sans.append(x509.DNSName(host))
    builder = (x509.CertificateBuilder().subject_name(_name(common_name))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.SubjectAlternativeName(sans), critical=False)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca_key.public_key()), critical=False))
    cert = _validity(builder, days).sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    # keys are created 0600 from the start, never readable by others even for a moment
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_cluster_certs(directory: str | Path, names: Iterable[str],
                        hosts: Iterable[str] = (), days: int = DEFAULT_DAYS,
                        ca: tuple[bytes, bytes] | None = None) -> dict[str, TlsConfig]:
    """A CA (or the given (cert, key)) and one leaf per name in `directory`:
    ca.crt, ca.key, <name>.crt, <name>.key. Returns name -> TlsConfig."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = ca or make_ca()
    _write(out / "ca.crt", ca_cert)
    _write(out / "ca.key", ca_key, private=True)
    hosts = list(hosts)
    configs = {}
    for name in names:
        cert, key = make_leaf(ca_cert, ca_key, name, hosts, days)
        _write(out / f"{name}.crt", cert)
        _write(out / f"{name}.key", key, private=True)
        configs[name] = TlsConfig(ca=str(out / "ca.crt"), cert=str(out / f"{name}.crt"),
                                  key=str(out / f"{name}.key"))
    return configs


__all__ = ["CLUSTER_NAME", "TlsConfig", "make_ca", "make_leaf", "write_cluster_certs"]
