"""The data plane's TLS stream (cluster/kv_transfer/tls_stream.py): an SSLObject over memory
BIOs on a blocking socket, in place of an SSLSocket. Checked against real sockets: bytes
arrive exactly (records cut at every size), a read and a write at once on two threads, the
peer's close mid-frame, and the refusals the SSLContext makes (another CA, plaintext)."""

from __future__ import annotations

import os
import socket
import ssl
import threading

import pytest

from cluster.kv_transfer.tcp_framing import recv_exact
from cluster.kv_transfer.tls_stream import TlsStream, client_stream, server_stream
from cluster.tls import CLUSTER_NAME, write_cluster_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tls")
    good = write_cluster_certs(base / "cluster", ["server", "client"])
    other = write_cluster_certs(base / "other", ["client"])["client"]
    return good["server"], good["client"], other


def _pair(certs, client_tls=None):
    """(server stream, client stream) over a loopback connection, handshakes done."""
    server_tls, good_client, _ = certs
    client_tls = client_tls or good_client
    srv = socket.create_server(("127.0.0.1", 0))
    out: dict = {}

    def accept():
        conn, _ = srv.accept()
        conn.settimeout(10)
        try:
            out["server"] = server_stream(conn, server_tls.server_context())
        except (ssl.SSLError, OSError) as exc:
            out["error"] = exc
            conn.close()
    t = threading.Thread(target=accept)
    t.start()
    sock = socket.create_connection(srv.getsockname(), 10)
    try:
        client = client_stream(sock, client_tls.client_context(), CLUSTER_NAME)
    finally:
        t.join(10)
        srv.close()
    return out, client


def test_bytes_arrive_exactly_in_both_directions(certs):
    out, client = _pair(certs)
    server = out["server"]
    assert server.version() == "TLSv1.3" and client.version() == "TLSv1.3"
    payload = os.urandom((5 << 20) + 12345)          # not a multiple of record or piece
    t = threading.Thread(target=client.sendall, args=(payload,))
    t.start()
    got = bytes(recv_exact(server, 17))
    got += bytes(recv_exact(server, len(payload) - 17, deadline=None))
    t.join(10)
    assert got == payload
    server.sendall(b"verdict")
    assert bytes(recv_exact(client, 7)) == b"verdict"
    client.close()
    assert server.recv_into(bytearray(10)) == 0      # the peer's close: end of stream
    server.close()


def test_reads_and_writes_on_two_threads_at_once(certs):
    """The sender's pattern: one thread writes the frames while another waits for the
    verdict, which can come before the writes end."""
    out, client = _pair(certs)
    server = out["server"]
    payload = os.urandom(3 << 20)
    verdict: list = []
    reader = threading.Thread(target=lambda: verdict.append(bytes(recv_exact(client, 4))))
    reader.start()

    def serve():
        server.sendall(b"ok!!")                      # early, while the client still writes
        assert bytes(recv_exact(server, len(payload))) == payload
    s = threading.Thread(target=serve)
    s.start()
    client.sendall(payload)
    s.join(20)
    reader.join(20)
    assert verdict == [b"ok!!"]
    client.close()
    server.close()


def test_close_mid_frame_reads_as_end_of_stream(certs):
    out, client = _pair(certs)
    server = out["server"]
    client.sendall(b"x" * 1000)
    client.close()
    with pytest.raises(ConnectionError):
        recv_exact(server, 2000)
    server.close()


def test_a_certificate_of_another_ca_is_refused(certs):
    _, _, other = certs
    # the other client trusts the real CA (so it accepts the server); its own certificate
    # the cluster CA never signed: the server refuses it during the handshake
    from cluster.tls import TlsConfig
    rogue = TlsConfig(ca=certs[1].ca, cert=other.cert, key=other.key)
    try:
        out, client = _pair(certs, rogue)
    except (ssl.SSLError, OSError):
        out, client = None, None
    if client is not None:                           # TLS 1.3: refused on the first read
        client.settimeout(5)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            if client.recv_into(bytearray(4)) == 0:
                raise ConnectionError("closed")
        client.close()
    assert out is None or isinstance(out.get("error"), ssl.SSLError)


def test_plaintext_peer_is_refused(certs):
    server_tls = certs[0]
    a, b = socket.socketpair()
    a.settimeout(5)
    b.sendall(b"\x00" * 64 + b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(ssl.SSLError):
        TlsStream(a, server_tls.server_context(), server_side=True).handshake()
    a.close()
    b.close()
