"""Raw-TCP KV data plane: the same push protocol as DecodeNode.PushKv, framed on a plain
socket so chunk bytes go from the sender's buffer to the receiver's buffer with no
protobuf or HTTP/2 copies. Control stays on gRPC: a prefill node learns a decode node's
data address from DecodeNode.GetNodeInfo (`kv_tcp_address`), and abort notices go over
gRPC. One connection per push.

Frame:  u32 meta_len | u64 data_len | meta (KvPushMessage, chunk.data left empty) | data
Reply:  u32 status (grpc.StatusCode value; 0 = OK) | u32 len | utf-8 message or PushAck
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import struct
import threading
from collections.abc import AsyncIterator

import grpc
import torch

from cluster.kv_transfer.base import KvTransport, PushFailed
from cluster.kv_transfer.grpc_transport import GrpcTransport
from cluster.kv_transfer.receiver import WRITTEN, PushHandler
from engine.pd_decode import PushRejected, UnknownReservation
from protos import node_pb2

log = logging.getLogger("cluster.kv_transfer")

_FRAME = struct.Struct("<IQ")
_REPLY = struct.Struct("<II")
_CODES = {c.value[0]: c for c in grpc.StatusCode}
MAX_META = 1 << 20
MAX_DATA = 64 << 20


def _recv_exact(sock: socket.socket, n: int):
    """Blocking read of exactly n bytes (the GIL is released while the kernel copies) into
    an uninitialised buffer (no zero-fill of megabytes about to be overwritten)."""
    buf = torch.empty(n, dtype=torch.uint8).numpy()
    view = memoryview(buf).cast("B")
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        view = view[got:]
    return buf


# Blocking sockets on threads rather than asyncio's sock_* calls: measured on a loaded
# 2-core machine, the event-loop round trip per partial read/write cost several times the
# transfer itself (bench/kv_transfer.py); threads get close to a raw socket.
class TcpKvServer:
    """Decode side: accepts pushes and feeds them to the same PushHandler as gRPC. A
    reader thread per connection turns frames into (message, bytes) items; the event loop
    runs the handler on them (bounded queue: backpressure to the sender)."""

    QUEUE_DEPTH = 8

    def __init__(self, handler: PushHandler, host: str = "127.0.0.1", port: int = 0):
        self.handler = handler
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._conns: set[socket.socket] = set()

    def address(self, advertise_host: str | None = None) -> str:
        host = advertise_host or self.host
        return f"{host}:{self.port}"

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._accept, name="kv-tcp-accept", daemon=True).start()

    async def stop(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for conn in list(self._conns):
            conn.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.add(conn)
            items: asyncio.Queue = asyncio.Queue()
            slots = threading.Semaphore(self.QUEUE_DEPTH)     # backpressure to the sender
            header_checked = threading.Event()
            state = {"refused": False}
            threading.Thread(target=self._read, daemon=True, name="kv-tcp-read",
                             args=(conn, items, slots, header_checked, state)).start()
            asyncio.run_coroutine_threadsafe(
                self._serve(conn, items, slots, header_checked, state), self._loop)

    def _read(self, conn: socket.socket, items: asyncio.Queue, slots: threading.Semaphore,
              header_checked: threading.Event, state: dict) -> None:
        """Frames -> items. Once the handler has accepted the header (reservation known,
        fingerprint equal), chunks are validated and written into the cache right here,
        by the same KvReceiver.write, and passed on as WRITTEN: no thread hop per chunk."""
        def put(item) -> None:
            slots.acquire()
            self._loop.call_soon_threadsafe(items.put_nowait, item)
        receiver = getattr(self.handler, "receiver", None)
        reservation_id = None
        try:
            while True:
                meta_len, data_len = _FRAME.unpack(_recv_exact(conn, _FRAME.size))
                if meta_len > MAX_META or data_len > MAX_DATA:
                    raise ValueError(f"frame too large ({meta_len} + {data_len} bytes)")
                msg = node_pb2.KvPushMessage.FromString(bytes(_recv_exact(conn, meta_len)))
                data = _recv_exact(conn, data_len) if data_len else None
                which = msg.WhichOneof("msg")
                if which == "header":
                    reservation_id = msg.header.reservation_id
                elif which == "chunk" and receiver is not None and reservation_id is not None:
                    header_checked.wait()
                    if state["refused"]:
                        return
                    c = msg.chunk
                    receiver.write(reservation_id, c.layer, c.kind, list(c.block_ids),
                                   list(c.shape), c.dtype, data)
                    data = WRITTEN
                put((msg, data))
                if which == "done":
                    return
        except Exception as exc:  # noqa: BLE001 - handed to the handler as the stream's end
            if not self._closed:
                try:
                    put(exc)
                except RuntimeError:      # the loop is gone
                    pass

    async def _serve(self, conn: socket.socket, items: asyncio.Queue,
                     slots: threading.Semaphore, header_checked: threading.Event,
                     state: dict) -> None:
        async def messages():
            first = True
            while True:
                if not first:
                    header_checked.set()      # the handler asked past the header: accepted
                first = False
                item = await items.get()
                slots.release()
                if isinstance(item, (PushRejected, UnknownReservation)):
                    raise item                # refused by KvReceiver.write on the reader
                if isinstance(item, Exception):
                    if isinstance(item, ValueError):
                        raise PushFailed(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                    return                    # connection lost: the handler refuses
                yield item
                if item[0].WhichOneof("msg") == "done":
                    return
        try:
            try:
                ack = await self.handler.handle(messages())
                reply = _REPLY.pack(0, ack.ByteSize()) + ack.SerializeToString()
            except PushFailed as exc:
                body = exc.message.encode()
                reply = _REPLY.pack(exc.code.value[0], len(body)) + body
            finally:
                state["refused"] = True       # a reader still waiting on the header stops
                header_checked.set()
            conn.setblocking(True)
            await _in_own_thread(conn.sendall, reply)
        except OSError as exc:
            log.warning("KV TCP push: the sender went away (%s)", exc)
        finally:
            self._conns.discard(conn)
            conn.close()


class TcpTransport(KvTransport):
    """Prefill side: pushes over the decode node's raw-TCP data plane; control messages
    (abort notices, the data-address lookup) over gRPC. Falls back to gRPC for a decode
    node that has no data plane. A sender thread writes the frames; a reply thread waits
    for the verdict, which can come early (a refusal), and then sending stops."""

    wants_raw_payload = True

    def __init__(self, grpc_transport: GrpcTransport | None = None):
        self.grpc = grpc_transport or GrpcTransport()
        self._data_address: dict[str, str] = {}

    async def _data_address_of(self, address: str) -> str:
        if address not in self._data_address:
            try:
                info = await self.grpc._stub(address).GetNodeInfo(node_pb2.NodeInfoRequest(),
                                                                  timeout=5.0)
            except grpc.aio.AioRpcError as exc:
                raise PushFailed(exc.code(), f"decode node {address}: {exc.details()}") from None
            self._data_address[address] = info.kv_tcp_address
        return self._data_address[address]

    async def push(self, address: str, messages: AsyncIterator) -> node_pb2.PushAck:
        data_address = await self._data_address_of(address)
        if not data_address:
            return await self.grpc.push(address, _as_messages(messages))
        host, _, port = data_address.rpartition(":")
        try:
            sock = await asyncio.to_thread(socket.create_connection,
                                           (host.strip("[]"), int(port)), 10.0)
        except OSError as exc:
            raise PushFailed(grpc.StatusCode.UNAVAILABLE,
                             f"KV data plane {data_address}: {exc}") from None
        sock.settimeout(None)
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
                out.put(_FRAME.pack(len(meta), len(data) if data is not None else 0) + meta)
                if data is not None:
                    out.put(data)
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


def _read_reply(sock: socket.socket) -> node_pb2.PushAck:
    try:
        code, n = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
        body = bytes(_recv_exact(sock, n))
    except (ConnectionError, OSError) as exc:
        raise PushFailed(grpc.StatusCode.UNAVAILABLE,
                         f"KV data plane connection lost: {exc}") from None
    if code == 0:
        return node_pb2.PushAck.FromString(body)
    raise PushFailed(_CODES.get(code, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))


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
                msg.chunk.data = bytes(data)
            yield msg
        else:
            yield item
