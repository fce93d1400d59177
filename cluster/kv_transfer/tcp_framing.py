"""Framing shared by both ends of the raw-TCP KV data plane (see tcp_transport.py)."""

from __future__ import annotations

import socket
import struct
import time

import grpc
import torch

FRAME = struct.Struct("<IQ")      # u32 meta_len | u64 data_len
REPLY = struct.Struct("<II")      # u32 status | u32 body length
CODES = {c.value[0]: c for c in grpc.StatusCode}
READY = REPLY.pack(0, 0)
_BUSY_TEXT = b"KV data plane busy: too many connections"
BUSY = REPLY.pack(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], len(_BUSY_TEXT)) + _BUSY_TEXT
MAX_META = 1 << 20
MAX_DATA = 64 << 20


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None):
    """Blocking read of exactly n bytes (the GIL is released while the kernel copies) into
    an uninitialised buffer (no zero-fill of megabytes about to be overwritten). With a
    deadline (time.monotonic()), TimeoutError once it passes: a slow trickle of bytes
    cannot hold the connection longer than a silent peer."""
    buf = torch.empty(n, dtype=torch.uint8).numpy()
    view = memoryview(buf).cast("B")
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("KV data plane: the peer is too slow or silent")
            sock.settimeout(left)
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        view = view[got:]
    return buf
