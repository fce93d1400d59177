"""Decode side of the raw-TCP KV data plane (protocol: tcp_transport.py; limits: limits.py).

The first frame must be the header, with no data; nothing after it is read until the
PushHandler has accepted it (reservation, push token, fingerprint), so a peer without a
token never makes the node allocate or write a chunk.

With `local=True` the same protocol is served on a Unix socket too, for prefill nodes on
this host (local_socket.py): no TLS there, the kernel vouches for the peer's user instead.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time

import grpc

from cluster.kv_transfer.base import PushFailed
from cluster.kv_transfer.kv_receiver import PushDenied, PushRejected, UnknownReservation
from cluster.kv_transfer.limits import TcpLimits
from cluster.kv_transfer.local_socket import LocalListener
from cluster.kv_transfer.receiver import WRITTEN, PushHandler
from cluster.kv_transfer.tcp_framing import BUSY, FRAME, MAX_DATA, MAX_META, READY, REPLY
from cluster.kv_transfer.tcp_framing import recv_exact as _recv_exact
from cluster.kv_transfer.tls_stream import server_stream
from cluster.omp_threads import serial_thread_pool
from cluster.tls import TlsConfig
from protos import node_pb2

log = logging.getLogger("cluster.kv_transfer")

LINGER_S = 1.0          # after an early refusal: how long to read off what the peer still sends


class _Conn:
    """One accepted connection: the reader thread's and the event loop's shared state."""

    def __init__(self, sock: socket.socket, depth: int, local: bool = False):
        self.sock = sock
        self.local = local                            # on the Unix socket: no TLS
        self.accepted = time.monotonic()
        self.items: asyncio.Queue = asyncio.Queue()
        self.slots = threading.Semaphore(depth)       # backpressure to the sender
        self.header_checked = threading.Event()       # set: accepted, or the handler ended
        self.finished = False                         # the handler has its verdict
        self.reply = b""                              # verdict bytes not yet sent
        self.replied = threading.Event()
        self.early = False                            # reading stopped before `done`
        self.untrusted = False                        # failed the TLS handshake: no reply


# Blocking sockets on threads rather than asyncio's sock_* calls: measured on a loaded
# 2-core machine, the event-loop round trip per partial read/write cost several times the
# transfer itself (bench/kv_transfer.py); threads get close to a raw socket. The threads
# come from one fixed pool of `max_connections`, and a connection over that is refused at
# accept, so open sockets cannot multiply threads.
class TcpKvServer:
    """Decode side: accepts pushes and feeds them to the same PushHandler as gRPC. A pool
    thread per served connection turns frames into (message, bytes) items; the event loop
    runs the handler on them (bounded queue: backpressure to the sender)."""

    QUEUE_DEPTH = 8

    def __init__(self, handler: PushHandler, host: str = "127.0.0.1", port: int = 0,
                 limits: TcpLimits | None = None, tls: TlsConfig | None = None,
                 local: bool = False):
        """tls: every TCP connection must complete a mutual-TLS handshake with a certificate
        of the cluster CA (within the header timeout) before anything is read. local: also
        listen on a Unix socket for this host's prefill nodes (`local_path`)."""
        self.handler = handler
        self.limits = limits or TcpLimits()
        self.tls = tls.server_context() if tls is not None else None
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(max(128, 2 * self.limits.max_connections))
        self.host, self.port = host, self.sock.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()                 # guards _conns
        # connection threads land KV chunks with torch copies: serially, so the engine's
        # OpenMP team stays the only one (cluster/omp_threads.py)
        self._pool = serial_thread_pool(self.limits.max_connections, "kv-tcp-conn")
        self.refused = 0            # connections turned away at the cap
        self.peak = 0               # most connections served at once
        self.pushes = 0             # pushes accepted and admitted over this plane
        self.untrusted = 0          # connections that failed the TLS handshake
        self.local_pushes = 0       # of `pushes`, those that came over the Unix socket
        self.local: LocalListener | None = None
        if local:
            try:
                self.local = LocalListener(max(128, 2 * self.limits.max_connections))
                self.local.sock.settimeout(0.5)       # so its accept loop sees a stop
            except OSError as exc:
                log.warning("KV data plane: no local Unix socket (%s); TCP only", exc)

    @property
    def local_path(self) -> str:
        """The Unix socket's path, or "" when there is none."""
        return self.local.path if self.local is not None else ""

    @property
    def active(self) -> int:
        return len(self._conns)

    def address(self, advertise_host: str | None = None) -> str:
        host = advertise_host or self.host
        return f"{host}:{self.port}"

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._accept, args=(self.sock, False), name="kv-tcp-accept",
                         daemon=True).start()
        if self.local is not None:
            threading.Thread(target=self._accept, args=(self.local.sock, True),
                             name="kv-local-accept", daemon=True).start()

    async def stop(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self.local is not None:
            self.local.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.finished = True
            c.header_checked.set()
            c.replied.set()
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._pool.shutdown(wait=False)

    def _accept(self, listener: socket.socket, local: bool) -> None:
        while not self._closed:
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed:
                    return
                log.warning("KV TCP accept failed: %s", exc)    # e.g. out of descriptors
                time.sleep(0.05)
                continue
            if local and not self.local.trusted(sock):
                self.untrusted += 1           # another user on this host: not a word
                log.info("KV local socket: a peer of another user refused")
                sock.close()
                continue
            sock.settimeout(None)             # (accepted sockets inherit the listener's)
            with self._lock:
                full = len(self._conns) >= self.limits.max_connections
                c = None if full else _Conn(sock, self.QUEUE_DEPTH, local)
                if c is not None:
                    self._conns.add(c)
                    self.peak = max(self.peak, len(self._conns))
            if c is None:
                self.refused += 1
                _refuse(sock)
                continue
            if not local:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pool.submit(self._run, c)
            asyncio.run_coroutine_threadsafe(self._serve(c), self._loop)

    # ---- the connection's pool thread ---------------------------------------------------
    def _run(self, c: _Conn) -> None:
        try:
            c.sock.settimeout(self.limits.header_timeout_s)
            if self.tls is not None and not c.local:
                self._handshake(c)
            c.sock.sendall(READY)
            self._read(c)
        except Exception as exc:  # noqa: BLE001 - handed to the handler as the stream's end
            # a refused chunk: the sender may still be sending, so close gracefully; a
            # silent or vanished peer gets no such courtesy
            c.early = not isinstance(exc, (TimeoutError, ConnectionError))
            self._put(c, exc)
        finally:
            try:
                # the verdict (a refusal may come while the sender is still sending); a
                # peer that failed the TLS handshake is no cluster member: not a word more
                if (not c.untrusted and c.replied.wait(self.limits.idle_timeout_s)
                        and c.reply):
                    c.sock.settimeout(self.limits.idle_timeout_s)
                    c.sock.sendall(c.reply)
                if c.early:
                    _linger(c.sock)
            except OSError as exc:
                log.info("KV TCP push: the sender went away (%s)", exc)
            finally:
                c.sock.close()
                with self._lock:
                    self._conns.discard(c)

    def _handshake(self, c: _Conn) -> None:
        """Mutual TLS before the greeting; a peer without a certificate of the cluster CA
        (or speaking plaintext, or too slow) is closed without one."""
        try:
            c.sock = server_stream(c.sock, self.tls)
        except (ssl.SSLError, OSError) as exc:
            c.untrusted = True
            self.untrusted += 1
            log.info("KV TCP: TLS handshake refused: %s", exc)
            raise ConnectionError("TLS handshake failed") from None

    def _put(self, c: _Conn, item) -> None:
        """Hand an item to the handler; dropped once it has its verdict (nobody reads)."""
        while not c.finished:
            if c.slots.acquire(timeout=0.5):
                break
        if c.finished or self._closed:
            return
        try:
            self._loop.call_soon_threadsafe(c.items.put_nowait, item)
        except RuntimeError:              # the loop is gone
            c.finished = True

    def _read(self, c: _Conn) -> None:
        """Frames -> items. Once the handler has accepted the header, chunks are validated
        and written into the cache right here, by the same KvReceiver.write, and passed on
        as WRITTEN: no thread hop per chunk."""
        receiver = getattr(self.handler, "receiver", None)
        idle = self.limits.idle_timeout_s
        header = None
        deadline = c.accepted + self.limits.header_timeout_s
        while True:
            meta_len, data_len = FRAME.unpack(_recv_exact(c.sock, FRAME.size, deadline))
            if meta_len > MAX_META or data_len > MAX_DATA:
                raise ValueError(f"frame too large ({meta_len} + {data_len} bytes)")
            if header is None and data_len:
                raise ValueError("the first frame must be the push header, without data")
            msg = node_pb2.KvPushMessage.FromString(bytes(_recv_exact(c.sock, meta_len,
                                                                      deadline)))
            data = _recv_exact(c.sock, data_len, deadline) if data_len else None
            which = msg.WhichOneof("msg")
            if header is None:
                if which != "header":
                    raise ValueError("a push must start with its header")
                header = msg.header
                self._put(c, (msg, None))
                # read on only once the handler accepted it (token, fingerprint)
                if not c.header_checked.wait(idle) or c.finished:
                    c.early = True
                    return
            else:
                if which == "chunk" and receiver is not None:
                    ch = msg.chunk
                    receiver.write(header.reservation_id, ch.layer, ch.kind,
                                   list(ch.block_ids), list(ch.shape), ch.dtype, data,
                                   token=header.push_token, num_layers=ch.num_layers)
                    data = WRITTEN
                self._put(c, (msg, data))
                if which == "done":
                    return
                if c.finished:                # refused while the sender still sends
                    c.early = True
                    return
            deadline = time.monotonic() + idle

    # ---- the connection on the event loop -----------------------------------------------
    async def _serve(self, c: _Conn) -> None:
        async def messages():
            first = True
            while True:
                if not first:
                    c.header_checked.set()    # the handler asked past the header: accepted
                first = False
                item = await c.items.get()
                c.slots.release()
                if isinstance(item, (PushRejected, PushDenied, UnknownReservation)):
                    raise item                # refused by KvReceiver.write on the reader
                if isinstance(item, Exception):
                    if isinstance(item, ValueError):
                        raise PushFailed(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                    return                    # connection lost or timed out: refused
                yield item
                if item[0].WhichOneof("msg") == "done":
                    return
        try:
            ack = await self.handler.handle(messages())
            reply = REPLY.pack(0, ack.ByteSize()) + ack.SerializeToString()
            self.pushes += 1
            self.local_pushes += c.local
        except PushFailed as exc:
            body = exc.message.encode()
            reply = REPLY.pack(exc.code.value[0], len(body)) + body
        finally:
            c.finished = True                 # a reader waiting on the header stops
            c.header_checked.set()
        # A verdict is a few bytes into an empty send buffer: sent from here without
        # blocking, so a refusal reaches a sender still streaming; the rest (never, in
        # practice) goes from the connection's thread.
        try:
            # a TLS stream takes no flags and its writes belong to the connection's thread
            tls = self.tls is not None and not c.local
            sent = 0 if tls else c.sock.send(reply, socket.MSG_DONTWAIT)
        except OSError:
            sent = 0
        c.reply = reply[sent:]
        c.replied.set()


def _refuse(sock: socket.socket) -> None:
    """Over the cap: say so (never blocking the accept thread) and close."""
    try:
        sock.setblocking(False)
        sock.send(BUSY)
    except OSError:
        pass
    sock.close()


def _linger(sock: socket.socket) -> None:
    """Close gracefully after an early verdict: read off what the sender still had in
    flight (briefly), so the close does not reset the connection before it read the
    verdict."""
    sock.shutdown(socket.SHUT_WR)
    scratch = bytearray(1 << 16)
    deadline = time.monotonic() + LINGER_S
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv_into(scratch) == 0:
                return
        except OSError:
            return
