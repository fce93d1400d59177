"""TLS for the raw-TCP KV data plane with few syscalls: an ssl.SSLObject over memory BIOs on
a blocking socket, instead of an ssl.SSLSocket.

Why (profiled, docs/PERFORMANCE.md "KV push with cluster TLS"): an SSLSocket makes OpenSSL
read each 16 KiB TLS record with two recv() calls (its 5-byte header, then its body) and
write each record with its own send(); on loopback every such call runs the TCP stack of
both ends (ACKs, wake-ups), which cost the receiver more CPU than the AES-GCM itself. Here
the socket is read in pieces of up to RAW_READ bytes (many records per syscall) that the
SSLObject decrypts from memory, and a write encrypts up to WRITE_PIECE bytes of records
into memory that go out in one sendall.

The security is the SSLContext's, unchanged: the same context (cluster CA, CERT_REQUIRED,
TLS 1.3 only), the same handshake and hostname check; only who moves the ciphertext
between the socket and OpenSSL differs. A handshake that fails raises ssl.SSLError.

Threads: reads (recv_into) and writes (sendall) may run on two threads at once, as the
sender's reply thread and send thread do. The socket I/O of each runs unlocked, but every
call into the SSL object and its BIOs holds one lock, so OpenSSL never sees two threads on
one connection (an SSLSocket would let SSL_read and SSL_write overlap, and a read that
answers with an alert writes).
"""

from __future__ import annotations

import socket
import ssl
import threading

RAW_READ = 1 << 20          # ciphertext read per recv() (many 16 KiB records)
WRITE_PIECE = 256 << 10     # plaintext encrypted per sendall()


class TlsStream:
    """A blocking, socket-like TLS connection: recv_into / sendall / settimeout / shutdown /
    close / setsockopt, the subset the data plane uses."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None):
        self.sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=server_side,
                                     server_hostname=server_hostname)
        self._raw = bytearray(RAW_READ)
        self._raw_view = memoryview(self._raw)
        self._timeout = self._applied = sock.gettimeout()
        self._lock = threading.Lock()      # one thread at a time in OpenSSL (see above)
        self._eof = False

    # ---- handshake ---------------------------------------------------------------------
    def handshake(self) -> None:
        """Blocking handshake under the socket's timeout; ssl.SSLError if the peer is not
        trusted (its alert, if any, is sent first), OSError if the socket fails."""
        try:
            while True:
                try:
                    with self._lock:
                        self._tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    self._flush()
                    if not self._fill():
                        raise ConnectionError("peer closed the connection during the "
                                              "TLS handshake") from None
        except ssl.SSLError:
            try:
                self._flush()           # the alert, so the peer learns why
            except OSError:
                pass
            raise
        self._flush()

    def version(self) -> str | None:
        return self._tls.version()

    def cipher(self):
        return self._tls.cipher()

    def getpeercert(self, binary_form: bool = False):
        return self._tls.getpeercert(binary_form)

    # ---- data ----------------------------------------------------------------------------
    def _flush(self) -> None:
        with self._lock:
            data = self._out.read()
        if data:
            self.sock.sendall(data)

    def _fill(self) -> bool:
        """One recv() of ciphertext into the incoming BIO; False at the peer's EOF."""
        self._apply_timeout()
        n = self.sock.recv_into(self._raw_view)
        with self._lock:
            if n == 0:
                self._in.write_eof()
                return False
            self._in.write(self._raw_view[:n])
        return True

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        """Plaintext into `buffer` (at most one TLS record, up to nbytes or its length);
        0 at the peer's end of the stream."""
        n = nbytes or len(buffer)
        while True:
            try:
                with self._lock:
                    return self._tls.read(n, buffer)
            except ssl.SSLWantReadError:
                if self._eof:
                    return 0            # the peer closed mid-record: the framing notices
                self._eof = not self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0                # closed, cleanly or not: the framing notices

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        got = self.recv_into(buf)
        return bytes(buf[:got])

    def sendall(self, data) -> None:
        self._apply_timeout()
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITE_PIECE):
            with self._lock:
                self._tls.write(view[start:start + WRITE_PIECE])
                data = self._out.read()
            self.sock.sendall(data)

    # ---- the socket underneath -----------------------------------------------------------
    def settimeout(self, timeout: float | None) -> None:
        """Applied to the socket at its next recv()/send(): a reader that sets a deadline
        before every record costs one ioctl per raw read, not per record."""
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def _apply_timeout(self) -> None:
        if self._timeout != self._applied:
            self.sock.settimeout(self._timeout)
            self._applied = self._timeout

    def setsockopt(self, *args) -> None:
        self.sock.setsockopt(*args)

    def fileno(self) -> int:
        return self.sock.fileno()

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> TlsStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def client_stream(sock: socket.socket, context: ssl.SSLContext,
                  server_hostname: str) -> TlsStream:
    stream = TlsStream(sock, context, server_side=False, server_hostname=server_hostname)
    stream.handshake()
    return stream


def server_stream(sock: socket.socket, context: ssl.SSLContext) -> TlsStream:
    stream = TlsStream(sock, context, server_side=True)
    stream.handshake()
    return stream
