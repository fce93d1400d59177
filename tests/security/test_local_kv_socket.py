"""The KV data plane's Unix socket for nodes on one host (cluster/kv_transfer/local_socket.py),
on a real decode node with mutual TLS on its gRPC server and TCP data plane: a prefill
node of this host pushes over the socket (no TLS there) and the request is served; the
socket is reachable by this user only (a private directory, the peer's user id checked by
the kernel's credentials); a decode node on another host, or a socket out of reach, gets
the push over TCP with TLS as before; and a push without the reservation's token is
refused on the socket as on TCP."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from cluster.kv_transfer import local_socket
from cluster.kv_transfer.base import PushFailed
from cluster.kv_transfer.grpc_transport import GrpcTransport, open_channel
from cluster.kv_transfer.tcp_framing import READY, REPLY
from cluster.kv_transfer.tcp_transport import TcpTransport
from protos import node_pb2, node_pb2_grpc
from tests.security.test_mtls import PROMPT, Node, _push_messages, _stream, certs, folder  # noqa: F401 - fixtures


async def _reserve(n: Node, channel, request_id: str = "r1"):
    stub = node_pb2_grpc.DecodeNodeStub(channel)
    call = stub.Decode(node_pb2.ReserveRequest(request_id=request_id, prompt_token_ids=PROMPT))
    return call, (await anext(aiter(call))).reservation


def test_a_prefill_node_on_this_host_pushes_over_the_unix_socket(folder, certs):  # noqa: F811
    async def main():
        async with Node(folder, certs["node"], local=True) as n:
            path = n.node.kv_tcp.local_path
            assert path and n.node.service.kv_local_socket == path
            # only this user may enter the directory or open the socket
            assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            async with open_channel(n.address, certs["client"]) as channel:
                info = await node_pb2_grpc.DecodeNodeStub(channel).GetNodeInfo(
                    node_pb2.NodeInfoRequest())
                assert (info.kv_local_socket, info.host_id) == (path, local_socket.host_id())
                call, res = await _reserve(n, channel)
                transport = TcpTransport(GrpcTransport(tls=certs["client"]))
                ack = await transport.push(n.address, _stream(_push_messages(n.node, res)))
                await transport.close()
                tokens = [t for ev in [e async for e in call] for t in ev.tokens.token_ids]
            assert ack.bytes_received > 0 and tokens and tokens[0] == 5
            assert transport.local_pushes == 1 and transport.fallbacks == 0
            assert (n.node.kv_tcp.pushes, n.node.kv_tcp.local_pushes) == (1, 1)
        assert not os.path.exists(os.path.dirname(path))          # removed on stop
    asyncio.run(main())


@pytest.mark.parametrize("why", ["another host", "socket out of reach"])
def test_otherwise_the_push_takes_tcp_with_tls(folder, certs, why, monkeypatch):  # noqa: F811
    async def main():
        async with Node(folder, certs["node"], local=True) as n:
            transport = TcpTransport(GrpcTransport(tls=certs["client"]))   # of this host
            if why == "another host":       # the decode node says it runs elsewhere
                monkeypatch.setattr(local_socket, "host_id", lambda: "another-boot/0")
            else:           # e.g. a container that shares the kernel, not the file system
                os.rename(n.node.kv_tcp.local_path, n.node.kv_tcp.local_path + ".moved")
            async with open_channel(n.address, certs["client"]) as channel:
                call, res = await _reserve(n, channel)
                ack = await transport.push(n.address, _stream(_push_messages(n.node, res)))
                await transport.close()
                tokens = [t for ev in [e async for e in call] for t in ev.tokens.token_ids]
            assert ack.bytes_received > 0 and tokens and tokens[0] == 5
            assert transport.local_pushes == 0
            assert (n.node.kv_tcp.pushes, n.node.kv_tcp.local_pushes) == (1, 0)
    asyncio.run(main())


def test_a_peer_of_another_user_is_refused_without_a_word(folder, certs, monkeypatch):  # noqa: F811
    """The kernel's credentials of the peer name another user id (here: this user's id is
    made to look different): closed before the greeting, counted as untrusted."""
    async def main():
        async with Node(folder, certs["node"], local=True) as n:
            kv = n.node.kv_tcp

            def greeting() -> bytes:
                with local_socket.connect(kv.local_path, 5.0) as sock:
                    return sock.recv(REPLY.size)
            assert await asyncio.to_thread(greeting) == READY
            me = os.getuid()
            monkeypatch.setattr(local_socket.os, "getuid", lambda: me + 1)
            assert await asyncio.to_thread(greeting) == b""
            assert kv.untrusted == 1 and kv.pushes == 0
    asyncio.run(main())


def test_a_push_without_the_reservations_token_is_refused_on_the_socket(folder, certs):  # noqa: F811
    async def main():
        async with Node(folder, certs["node"], local=True) as n:
            async with open_channel(n.address, certs["client"]) as channel:
                call, res = await _reserve(n, channel)
                msgs = _push_messages(n.node, res)
                msgs[0].header.push_token = b"\x00" * len(res.push_token)
                transport = TcpTransport(GrpcTransport(tls=certs["client"]))
                with pytest.raises(PushFailed) as info:
                    await transport.push(n.address, _stream(msgs))
                await transport.close()
                call.cancel()
            assert transport.local_pushes == 1          # it did go over the socket
            assert "token" in info.value.message
            assert n.node.kv_tcp.pushes == 0
    asyncio.run(main())
