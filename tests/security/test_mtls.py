"""Mutual TLS on the node links (cluster/tls.py): a real decode node on a tiny model behind
a real gRPC server and its raw-TCP data plane, both with certificates of one cluster CA.

Refused: a plaintext client, a client whose certificate comes from another CA, a client
with no certificate. Served: a client with a certificate of the cluster CA (a real Decode
call over gRPC, and its KV pushed over the data plane with TLS).
"""

from __future__ import annotations

import asyncio
import socket
import ssl

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.kv_transfer.base import PushFailed
from cluster.kv_transfer.grpc_transport import GrpcTransport, open_channel
from cluster.kv_transfer.tcp_framing import READY, REPLY
from cluster.kv_transfer.tcp_transport import TcpTransport
from cluster.node_server import GrpcNodeServer
from cluster.tls import CLUSTER_NAME, TlsConfig, write_cluster_certs
from decode_node.node import DecodeNode
from engine.config import EngineConfig
from protos import node_pb2, node_pb2_grpc
from tests.tiny_models import make_tiny_model

OPTS = dict(dtype="float32", block_size=4, num_gpu_blocks=64, max_num_seqs=4)
PROMPT = [40, 41, 42, 43, 44, 45, 46]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("qwen3-qknorm-hd24", tmp_path_factory.mktemp("models"))[0]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """The cluster's CA with a node and a client leaf; a rogue CA with its own client."""
    base = tmp_path_factory.mktemp("tls")
    good = write_cluster_certs(base / "cluster", ["node", "client"])
    rogue = write_cluster_certs(base / "rogue", ["client"])["client"]
    # a rogue client that trusts the real CA (so it would accept the server) but whose own
    # certificate the cluster CA never signed
    return {"node": good["node"], "client": good["client"],
            "rogue": TlsConfig(ca=good["client"].ca, cert=rogue.cert, key=rogue.key)}


class Node:
    """DecodeNode + GrpcNodeServer, both with the node's TLS; started on the running loop.
    local: the data plane's Unix socket for this host's prefill nodes too (off here, where
    the pushes must take TCP and its TLS; tests/security/test_local_kv_socket.py has it on)."""

    def __init__(self, folder, tls: TlsConfig, local: bool = False):
        self.node = DecodeNode(EngineConfig(model=str(folder), **OPTS),
                               kv_tcp_listen="127.0.0.1:0", tls=tls, kv_local_socket=local)
        self.server = GrpcNodeServer(self.node.SERVICE, "127.0.0.1:0", tls=tls)
        self.server.add(self.node.add_to_server, self.node.service)

    async def __aenter__(self):
        port = await self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.node.start(advertise_host="127.0.0.1")
        await self.server.set_serving(True)
        return self

    async def __aexit__(self, *exc):
        await self.server.stop(grace=0.5)
        await self.node.stop()

    @property
    def data_address(self) -> tuple[str, int]:
        host, _, port = self.node.service.kv_tcp_address.rpartition(":")
        return host, int(port)


async def _health(address: str, tls: TlsConfig | None, cert_less: bool = False):
    if cert_less:       # trusts the cluster CA, shows no certificate of its own
        creds = grpc.ssl_channel_credentials(root_certificates=open(tls.ca, "rb").read())
        channel = grpc.aio.secure_channel(address, creds, tls.grpc_channel_options())
    else:
        channel = open_channel(address, tls)
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return await stub.Check(health_pb2.HealthCheckRequest(), timeout=5.0)


def _push_messages(node: DecodeNode, res) -> list[node_pb2.KvPushMessage]:
    """A whole push for `res` (zeros as KV: what matters here is that it is accepted)."""
    fp = node.fingerprint
    ids = list(res.block_ids)[res.num_cached_blocks:]
    shape = [len(ids), fp.block_size, fp.num_kv_heads, fp.head_dim]
    zeros = bytes(4 * shape[0] * shape[1] * shape[2] * shape[3])
    msgs = [node_pb2.KvPushMessage(header=node_pb2.PushHeader(
        request_id="r1", reservation_id=res.reservation_id, fingerprint=res.fingerprint,
        block_ids=ids, push_token=res.push_token))]
    msgs += [node_pb2.KvPushMessage(chunk=node_pb2.KvChunk(
        layer=layer, kind=kind, block_ids=ids, shape=shape, dtype="float32", data=zeros))
        for layer in range(fp.num_layers) for kind in (0, 1)]
    return msgs + [node_pb2.KvPushMessage(done=node_pb2.PushDone(
        first_token_id=5, num_chunks=len(msgs) - 1))]


async def _stream(msgs):
    for m in msgs:
        yield m


def test_grpc_server_admits_only_clients_of_the_cluster_ca(folder, certs):
    async def main():
        async with Node(folder, certs["node"]) as n:
            reply = await _health(n.address, certs["client"])
            assert health_pb2.HealthCheckResponse.SERVING == reply.status
            refused = {}
            for name, tls, cert_less in (("plaintext", None, False),
                                         ("rogue CA", certs["rogue"], False),
                                         ("no client certificate", certs["client"], True)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _health(n.address, tls, cert_less)
                refused[name] = info.value.code()
            assert refused == {k: grpc.StatusCode.UNAVAILABLE for k in refused}
            # and the cluster's client still works after the refusals
            reply = await _health(n.address, certs["client"])
            assert health_pb2.HealthCheckResponse.SERVING == reply.status
    asyncio.run(main())


def _greeting_over(sock: socket.socket) -> bytes:
    """What the data plane says first (b"" when it closes without a word)."""
    sock.settimeout(5.0)
    try:
        return sock.recv(REPLY.size)
    except (ssl.SSLError, ConnectionError):
        return b""


def test_data_plane_refuses_plaintext_and_foreign_certificates(folder, certs):
    async def main():
        async with Node(folder, certs["node"]) as n:
            kv = n.node.kv_tcp
            with socket.create_connection(n.data_address, 5.0) as plain:
                plain.sendall(b"\x00" * 64)                  # a plaintext peer's "header"
                got_plain = await asyncio.to_thread(_greeting_over, plain)

            def rogue_greeting() -> bytes:
                sock = socket.create_connection(n.data_address, 5.0)
                try:
                    # TLS 1.3: the client's handshake ends before the server has checked
                    # the client's certificate; the refusal arrives as the first read
                    tls = certs["rogue"].wrap_client(sock)
                except ssl.SSLError:
                    sock.close()
                    return b""
                with tls:
                    return _greeting_over(tls)
            got_rogue = await asyncio.to_thread(rogue_greeting)

            def good_greeting() -> bytes:
                with certs["client"].wrap_client(socket.create_connection(n.data_address,
                                                                          5.0)) as tls:
                    return _greeting_over(tls)
            got_good = await asyncio.to_thread(good_greeting)
            assert (got_plain, got_rogue, got_good) == (b"", b"", READY)
            assert kv.untrusted == 2 and kv.pushes == 0
    asyncio.run(main())


def test_push_with_cluster_certificates_over_tls_serves_the_request(folder, certs):
    async def main():
        async with Node(folder, certs["node"]) as n:
            async with open_channel(n.address, certs["client"]) as channel:
                stub = node_pb2_grpc.DecodeNodeStub(channel)
                call = stub.Decode(node_pb2.ReserveRequest(request_id="r1",
                                                           prompt_token_ids=PROMPT))
                res = (await anext(aiter(call))).reservation
                # a client of another CA cannot push, over TLS or the gRPC fallback
                rogue = TcpTransport(GrpcTransport(tls=certs["rogue"]))
                with pytest.raises(PushFailed):
                    await rogue.push(n.address, _stream(_push_messages(n.node, res)))
                await rogue.close()
                transport = TcpTransport(GrpcTransport(tls=certs["client"]))
                ack = await transport.push(n.address, _stream(_push_messages(n.node, res)))
                await transport.close()
                tokens = [t for ev in [e async for e in call] for t in ev.tokens.token_ids]
            assert ack.bytes_received > 0
            assert n.node.kv_tcp.pushes == 1 and transport.fallbacks == 0
            assert tokens and tokens[0] == 5          # the pushed first token, then decoding
    asyncio.run(main())


def test_certificates_name_the_cluster_and_need_all_three_files(certs, tmp_path):
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(open(certs["node"].cert, "rb").read())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert CLUSTER_NAME in sans.get_values_for_type(x509.DNSName)
    assert TlsConfig.from_args(None, None, None) is None
    with pytest.raises(ValueError, match="--tls-key"):
        TlsConfig.from_args(certs["node"].ca, certs["node"].cert, None)
    with pytest.raises(ValueError, match="no such file"):
        TlsConfig.from_args(certs["node"].ca, certs["node"].cert, str(tmp_path / "missing"))
