"""A whole cluster on loopback as child processes: etcd, N prefill nodes, M decode nodes and
one router. Used by `pdserve up` and by the integration tests.

Children get their own session (process group), so a Ctrl-C reaches only the launcher, which
then stops them in order: the router first (no new requests), then the nodes (SIGTERM drains
them), then etcd. Everything is stopped by the PIDs recorded here, nothing by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Child:
    name: str
    cmd: list[str]
    log_path: Path
    ready_file: Path | None = None
    proc: subprocess.Popen | None = None

    def start(self, env: dict) -> Child:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def ready(self) -> str | None:
        if self.ready_file is not None and self.ready_file.is_file():
            text = self.ready_file.read_text().strip()
            return text or None
        return None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.proc.wait()


@dataclass
class LocalClusterConfig:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    http_port: int = 8000
    grpc_port: int = 50051
    cluster: str = "local"
    policy: str | None = None
    node_args: list[str] = field(default_factory=list)     # extra engine flags for nodes
    prefill_args: list[str] = field(default_factory=list)  # ... for prefill nodes only
    decode_args: list[str] = field(default_factory=list)   # ... for decode nodes only
    router_args: list[str] = field(default_factory=list)
    lease_ttl: int = 3
    run_dir: Path | None = None


class LocalCluster:
    def __init__(self, config: LocalClusterConfig):
        import tempfile

        from launch.etcd_server import EtcdServer

        if config.num_prefill < 1 or config.num_decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode node")
        self.config = config
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.etcd = EtcdServer(self.run_dir / "etcd")
        self.nodes: list[Child] = []
        self.router: Child | None = None
        self.http_url = ""
        self.grpc_address = ""
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}

    # ---- children ------------------------------------------------------------------------
    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "launch.cli", *args]

    def add_node(self, role: str, index: int | None = None) -> Child:
        from launch.etcd_server import free_port

        index = index if index is not None else sum(1 for n in self.nodes
                                                    if n.name.startswith(role))
        name = f"{role}-{index}"
        ready = self.run_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        cmd = self._cli(role, "--listen", f"127.0.0.1:{free_port()}", "--etcd",
                        self.etcd.endpoint, "--cluster", self.config.cluster, "--node-id", name,
                        "--lease-ttl", str(self.config.lease_ttl), "--ready-file", str(ready),
                        "--model", self.config.model, *self.config.node_args,
                        *(self.config.decode_args if role == "decode"
                          else self.config.prefill_args))
        child = Child(name, cmd, self.run_dir / f"{name}.log", ready).start(self.env)
        self.nodes.append(child)
        return child

    def add_router(self, http_port: int, grpc_port: int, name: str = "router") -> Child:
        ready = self.run_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        cmd = self._cli("router", "--http", f"127.0.0.1:{http_port}", "--grpc",
                        f"127.0.0.1:{grpc_port}", "--etcd", self.etcd.endpoint, "--cluster",
                        self.config.cluster, "--model", self.config.model, "--ready-file",
                        str(ready), *self.config.router_args)
        if self.config.policy:
            cmd += ["--policy", self.config.policy]
        return Child(name, cmd, self.run_dir / f"{name}.log", ready).start(self.env)

    def wait_ready(self, children: list[Child], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(children)
        while pending:
            for child in list(pending):
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited with status "
                                       f"{child.proc.returncode}; its log "
                                       f"({child.log_path}):\n{child.log_tail()}")
                if child.ready() is not None:
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise TimeoutError(f"not ready within {timeout:.0f} s: {names}; logs in "
                                   f"{self.run_dir}")
            time.sleep(0.1)

    def wait_healthy(self, http_url: str, timeout: float) -> None:
        """The router's /health turns 200 once it knows a prefill and a decode node."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{http_url}/health", timeout=2) as resp:
                    if resp.getcode() == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {http_url} not healthy within {timeout:.0f} s")
            time.sleep(0.2)

    # ---- whole cluster -------------------------------------------------------------------
    def start(self, timeout: float = 300.0) -> LocalCluster:
        c = self.config
        try:
            self.etcd.start()
            for _ in range(c.num_prefill):
                self.add_node("prefill")
            for _ in range(c.num_decode):
                self.add_node("decode")
            self.router = self.add_router(c.http_port, c.grpc_port)
            self.wait_ready(self.nodes + [self.router], timeout)
            addresses = json.loads(self.router.ready())
            self.http_url, self.grpc_address = addresses["http"], addresses["grpc"]
            self.wait_healthy(self.http_url, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def dead_children(self) -> list[Child]:
        return [c for c in self.nodes + ([self.router] if self.router else []) if not c.alive()]

    def stop(self, timeout: float = 30.0) -> None:
        if self.router is not None:
            self.router.signal(signal.SIGTERM)
            self.router.wait(timeout)
        for node in self.nodes:
            node.signal(signal.SIGTERM)
        for node in self.nodes:
            node.wait(timeout)
        self.etcd.stop()
