"""Raw-TCP KV data plane: the same push protocol as DecodeNode.PushKv, framed on a plain
socket so chunk bytes go from the sender's buffer to the receiver's buffer with no
protobuf or HTTP/2 copies. Control stays on gRPC: a prefill node learns a decode node's
data address from DecodeNode.GetNodeInfo (`kv_tcp_address`), and abort notices go over
gRPC. One connection per push.

A decode node on the same host (its NodeInfo's `host_id` equals ours) is reached on its
Unix socket instead (`kv_local_socket`, local_socket.py), without TLS; when that connect
fails (another container's file system, say) the push takes TCP.

Greeting (server, on connect): a reply with status 0 and no body = ready; any other
status = refused (over the connection cap): the sender pushes over gRPC instead.
Frame:  u32 meta_len | u64 data_len | meta (KvPushMessage, chunk.data left empty) | data
Reply:  u32 status (grpc.StatusCode value; 0 = OK) | u32 len | utf-8 message or PushAck

This module is the prefill side (TcpTransport); the decode side is tcp_server.py
(TcpKvServer, re-exported here), its limits limits.py, the shared framing tcp_framing.py.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading
from collections.abc import AsyncIterator

import grpc

from cluster.kv_transfer import local_socket
from cluster.kv_transfer.base import KvTransport, PushFailed
from cluster.kv_transfer.grpc_transport import GrpcTransport
from cluster.kv_transfer.tcp_framing import CODES, FRAME, REPLY
from cluster.kv_transfer.tcp_framing import recv_exact as _recv_exact
from cluster.kv_transfer.tcp_server import TcpKvServer
from cluster.kv_transfer.tls_stream import client_stream
from cluster.omp_threads import serial_torch_thread
from cluster.tls import CLUSTER_NAME
from protos import node_pb2

__all__ = ["TcpKvServer", "TcpTransport"]

log = logging.getLogger("cluster.kv_transfer")


class TcpTransport(KvTransport):
    """Prefill side: pushes over the decode node's raw-TCP data plane; control messages
    (abort notices, the data-address lookup) over gRPC. Falls back to gRPC for a decode
    node that has no data plane, and for a push the data plane turns away (its connection
    cap reached, or no greeting): nothing was sent yet, so the same messages go over
    DecodeNode.PushKv. A sender thread writes the frames; a reply thread waits for the
    verdict, which can come early (a refusal), and then sending stops."""

    wants_raw_payload = True

    def __init__(self, grpc_transport: GrpcTransport | None = None):
        """TLS follows the gRPC transport's: with it, the data plane is mutual TLS too."""
        self.grpc = grpc_transport or GrpcTransport()
        tls = getattr(self.grpc, "tls", None)     # a stand-in transport may have none
        self._tls = (tls, tls.client_context()) if tls is not None else None
        self._data_address: dict[str, tuple[str, str]] = {}   # address -> (TCP, local)
        self.fallbacks = 0          # pushes sent over gRPC because the data plane said no
        self.local_pushes = 0       # pushes that went over a decode node's Unix socket
        self._host_id = local_socket.host_id()

    async def _data_address_of(self, address: str) -> tuple[str, str]:
        """The decode node's TCP data address and, when it runs on this host, its Unix
        socket ("" for what it lacks)."""
        if isinstance(self.grpc, GrpcTransport):   # (not a test's stand-in transport)
            await self.grpc.close_idle()   # a decode node unused for long may be gone, or
            for gone in [a for a in self._data_address if not self.grpc.has_channel(a)]:
                del self._data_address[gone]   # back elsewhere: ask it again
        if address not in self._data_address:
            try:
                info = await self.grpc.node_info(address)
            except grpc.aio.AioRpcError as exc:
                raise PushFailed(exc.code(), f"decode node {address}: {exc.details()}") from None
            same_host = bool(self._host_id) and info.host_id == self._host_id
            self._data_address[address] = (info.kv_tcp_address,
                                           info.kv_local_socket if same_host else "")
        return self._data_address[address]

    async def push(self, address: str, messages: AsyncIterator) -> node_pb2.PushAck:
        tcp_address, local_path = await self._data_address_of(address)
        sock, data_address = None, tcp_address
        if local_path:
            try:
                sock = await asyncio.to_thread(local_socket.connect, local_path, 10.0)
                data_address = local_path
            except OSError as exc:
                log.info("decode node %s: its local KV socket %s is out of reach (%s); "
                         "TCP from now on", address, local_path, exc)
                self._data_address[address] = (tcp_address, "")
        if sock is None and not tcp_address:
            return await self.grpc.push(address, _as_messages(messages))
        if sock is None:
            host, _, port = tcp_address.rpartition(":")
            try:
                sock = await asyncio.to_thread(self._connect, host.strip("[]"), int(port))
            except OSError as exc:
                raise PushFailed(grpc.StatusCode.UNAVAILABLE,
                                 f"KV data plane {tcp_address}: {exc}") from None
        refused = await asyncio.to_thread(_greeting, sock)
        if refused:
            sock.close()
            self.fallbacks += 1
            log.warning("KV data plane %s refused the push (%s); pushing over gRPC",
                        data_address, refused)
            return await self.grpc.push(address, _as_messages(messages))
        sock.settimeout(None)
        if data_address == local_path:
            self.local_pushes += 1
        else:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out: queue.SimpleQueue = queue.SimpleQueue()
        sent = _in_own_thread(_send_all, sock, out)
        reply = _in_own_thread(_read_reply, sock)
        try:
            async for item in messages:
                if reply.done() or sent.done():     # refused early, or the socket broke
                    break
                msg, data = item if isinstance(item, tuple) else _split(item)
                meta = msg.SerializeToString()
                # one chunk's bytes may come as several buffers (a layer run's K and V)
                bufs = [] if data is None else data if isinstance(data, list) else [data]
                out.put(FRAME.pack(len(meta), sum(len(b) for b in bufs)) + meta)
                for buf in bufs:
                    out.put(buf)
        finally:
            out.put(None)
        try:
            return await asyncio.wait_for(reply, 120.0)
        except TimeoutError:
            raise PushFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"no verdict from KV data plane {data_address}") from None
        finally:
            sock.close()
            await asyncio.gather(sent, return_exceptions=True)

    def _connect(self, host: str, port: int):
        sock = socket.create_connection((host, port), 10.0)
        if self._tls is None:
            return sock
        _, context = self._tls
        try:
            return client_stream(sock, context, CLUSTER_NAME)  # ssl.SSLError is an OSError
        except OSError:
            sock.close()
            raise

    async def abort_reservation(self, address: str, request: node_pb2.AbortRequest) -> bool:
        return await self.grpc.abort_reservation(address, request)

    async def close(self) -> None:
        await self.grpc.close()


def _in_own_thread(fn, *args) -> asyncio.Future:
    """Run a blocking socket loop on a thread of its own: not on the default executor, whose
    few workers (cpu count + 4) concurrent pushes would exhaust while blocked on sockets."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result=None, exc=None) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(result)

    def run() -> None:
        try:
            serial_torch_thread()       # the engine's OpenMP team stays the only one
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result)
    threading.Thread(target=run, daemon=True, name=f"kv-tcp-{fn.__name__}").start()
    return fut


def _send_all(sock: socket.socket, out: queue.SimpleQueue) -> None:
    try:
        while (buf := out.get()) is not None:
            sock.sendall(buf)
    except OSError:
        pass                                  # the reply says why, or the push is lost


def _greeting(sock: socket.socket, timeout: float = 10.0) -> str | None:
    """None when the data plane is ready for this push, else why not."""
    try:
        sock.settimeout(timeout)
        code, n = REPLY.unpack(_recv_exact(sock, REPLY.size))
        if code == 0:
            return None
        return bytes(_recv_exact(sock, min(n, 4096))).decode(errors="replace")
    except (ConnectionError, OSError) as exc:
        return f"no greeting: {exc}"


def _read_reply(sock: socket.socket) -> node_pb2.PushAck:
    try:
        code, n = REPLY.unpack(_recv_exact(sock, REPLY.size))
        body = bytes(_recv_exact(sock, n))
    except (ConnectionError, OSError) as exc:
        raise PushFailed(grpc.StatusCode.UNAVAILABLE,
                         f"KV data plane connection lost: {exc}") from None
    if code == 0:
        return node_pb2.PushAck.FromString(body)
    raise PushFailed(CODES.get(code, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))


def _split(msg: node_pb2.KvPushMessage) -> tuple[node_pb2.KvPushMessage, bytes | None]:
    if msg.WhichOneof("msg") != "chunk" or not msg.chunk.data:
        return msg, None
    data = msg.chunk.data
    meta = node_pb2.KvPushMessage()
    meta.CopyFrom(msg)
    meta.chunk.ClearField("data")
    return meta, data


async def _as_messages(items: AsyncIterator) -> AsyncIterator[node_pb2.KvPushMessage]:
    """(meta, data) pairs back into whole messages, for the gRPC fallback."""
    async for item in items:
        if isinstance(item, tuple):
            msg, data = item
            if data is not None:
                msg.chunk.data = b"".join(data) if isinstance(data, list) else bytes(data)
            yield msg
        else:
            yield item
