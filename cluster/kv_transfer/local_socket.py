"""The KV data plane between nodes on one host: a Unix-domain socket instead of TCP + TLS.

Why: on a box where a prefill node and a decode node share the cores, mutual TLS on the
data plane encrypts every KV byte on one side and decrypts it on the other, on the same
cores that run both engines (AES-GCM at ~2 GB/s a core: a 256-token SmolLM2 prompt is 5.9
MB, a prefill step of 8 of them 47 MB each way). Bytes that never leave the host's kernel
need no cipher; what they need is that only a node of this cluster can connect, which a
Unix socket gives without one:

- the socket lies in a directory only this user may enter (mkdtemp: mode 0700), under a
  random name, so no other user can reach it, and a pod that shares the host but not the
  file system cannot find it (its connect fails: the sender takes TCP + TLS);
- the server reads the peer's credentials from the kernel (SO_PEERCRED) and serves only
  its own user id; and the push itself still carries the reservation's push token, checked
  as on every other plane.

A decode node advertises the socket's path with its host id (the kernel's boot id and
this user's id: equal only for processes of one user on one running kernel); a prefill
node whose host id is the same connects there, and any failure to connect falls back to
the TCP data plane.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path

SOCKET_NAME = "kv.sock"
_UCRED = struct.Struct("3i")        # pid, uid, gid


def host_id() -> str:
    """This kernel's boot id and this user's id: the same for every process of the user on
    the running host (and for containers sharing its kernel, whose file systems the path
    check then tells apart)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""                   # not Linux: no local plane
    return f"{boot}/{os.getuid()}"


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)[1]


class LocalListener:
    """A listening Unix socket in a fresh private directory, removed on close."""

    def __init__(self, backlog: int):
        self.dir = tempfile.mkdtemp(prefix="pdserve-kv-")      # mode 0700
        self.path = os.path.join(self.dir, SOCKET_NAME)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.path)
            os.chmod(self.path, 0o600)
            self.sock.listen(backlog)
        except OSError:
            self.close()
            raise

    def trusted(self, conn: socket.socket) -> bool:
        """Whether the connected peer runs as this user."""
        try:
            return peer_uid(conn) == os.getuid()
        except OSError:
            return False

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def connect(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock
