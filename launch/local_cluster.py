"""A whole cluster on loopback as child processes: etcd, N prefill nodes, M decode nodes, K
aggregated nodes (prefill and decode on one node; `pdserve up --aggregated`) and one router.
Used by `pdserve up` and by the integration tests.

Children get their own session (process group), so a Ctrl-C reaches only the launcher, which
then stops them in order: the router first (no new requests), then the nodes (SIGTERM drains
them), then etcd. Everything is stopped by the PIDs recorded here, nothing by name.

Once started, `supervise()` (polled by `pdserve up`) restarts a node that crashed, with
backoff on a fresh port (launch/supervisor.py), and returns only the children the cluster
cannot go on without. `dead_children()` only reports, never restarts: tests that kill nodes
on purpose use it (or nothing) and see their nodes stay dead.
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


def _say(message: str) -> None:
    print(f"pdserve: {message}", flush=True)


@dataclass
class Child:
    name: str
    cmd: list[str]
    log_path: Path
    ready_file: Path | None = None
    proc: subprocess.Popen | None = None
    role: str = ""                  # nodes: prefill | decode | aggregated (what a restart
                                    # rebuilds)

    def start(self, env: dict, append: bool = False) -> Child:
        # a restarted node appends, so its log keeps what the last life said before dying
        with open(self.log_path, "ab" if append else "wb") as log:
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
    num_aggregated: int = 0         # nodes that prefill and decode by themselves
    http_port: int = 8000
    grpc_port: int = 50051
    cluster: str = "local"
    policy: str | None = None
    node_args: list[str] = field(default_factory=list)     # extra engine flags for nodes
    prefill_args: list[str] = field(default_factory=list)  # ... for prefill nodes only
    decode_args: list[str] = field(default_factory=list)   # ... for decode nodes only
    aggregated_args: list[str] = field(default_factory=list)   # ... for aggregated nodes only
    router_args: list[str] = field(default_factory=list)
    lease_ttl: int = 3
    run_dir: Path | None = None
    restart_nodes: bool = True      # supervise() restarts crashed nodes
    # Mutual TLS between router and nodes (a throw-away CA in run_dir/tls, one leaf per
    # process): on by default, so the secure path is the one every local run exercises.
    tls: bool = True
    # Nodes on this machine's cores take turns at engine steps (cluster/core_share.py): a
    # lock file in run_dir. Off for nodes on separate cores or accelerators.
    core_share: bool = False


class LocalCluster:
    def __init__(self, config: LocalClusterConfig):
        import tempfile

        from launch.etcd_server import EtcdServer

        if min(config.num_prefill, config.num_decode, config.num_aggregated) < 0:
            raise ValueError("node counts cannot be negative")
        if (config.num_prefill > 0) != (config.num_decode > 0):
            raise ValueError("prefill and decode nodes only serve in pairs: start at least "
                             "one of each, or neither")
        if config.num_decode < 1 and config.num_aggregated < 1:
            raise ValueError("a cluster needs at least one prefill and one decode node, or "
                             "one aggregated node")
        self.config = config
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._ca = None
        etcd_tls = None
        if config.tls:
            from cluster.tls import make_ca, write_cluster_certs
            self._ca = make_ca("pdserve up CA (throw-away)")
            # ca.crt for clients, and etcd's own leaf: etcd serves https and requires a
            # client certificate of this CA, so only the cluster's processes reach it
            etcd_tls = write_cluster_certs(self.tls_dir, ["etcd"], ca=self._ca)["etcd"]
        self.etcd = EtcdServer(self.run_dir / "etcd", tls=etcd_tls)
        self.nodes: list[Child] = []
        self.router: Child | None = None
        self.supervisor = None          # a Supervisor once start() succeeded
        self._etcd_child: Child | None = None     # what the supervisor watches for etcd
        self.notify = _say
        self.http_url = ""
        self.grpc_address = ""
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}

    @property
    def tls_dir(self) -> Path:
        return self.run_dir / "tls"

    def tls_flags(self, name: str) -> list[str]:
        """--tls-* and --etcd-ca/cert/key for the process `name`: its own leaf (made once,
        kept across restarts) for the node links and for etcd alike."""
        if self._ca is None:
            return []
        from cluster.tls import TlsConfig, write_cluster_certs
        cert = self.tls_dir / f"{name}.crt"
        if cert.exists():
            tls = TlsConfig(str(self.tls_dir / "ca.crt"), str(cert),
                            str(self.tls_dir / f"{name}.key"))
        else:
            tls = write_cluster_certs(self.tls_dir, [name], ca=self._ca)[name]
        return ["--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key,
                "--etcd-ca", tls.ca, "--etcd-cert", tls.cert, "--etcd-key", tls.key]

    # ---- children ------------------------------------------------------------------------
    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "launch.cli", *args]

    def _node_cmd(self, role: str, name: str, ready: Path) -> list[str]:
        # Port 0: the node binds a free port itself and advertises the one it got (etcd,
        # its ready file). A port picked here and closed again could be taken by another
        # process before the node, 5-30 s later, binds it ("Address already in use").
        return self._cli(role, "--listen", "127.0.0.1:0", "--etcd",
                         self.etcd.endpoint, "--cluster", self.config.cluster, "--node-id",
                         name, "--lease-ttl", str(self.config.lease_ttl), "--ready-file",
                         str(ready), "--model", self.config.model, *self.tls_flags(name),
                         *self._core_share_flags(), *self.config.node_args,
                         *self._role_args(role))

    def _core_share_flags(self) -> list[str]:
        if not self.config.core_share:
            return []
        return ["--core-share-lock", str(self.run_dir / "cores.lock")]

    def _role_args(self, role: str) -> list[str]:
        return {"prefill": self.config.prefill_args, "decode": self.config.decode_args,
                "aggregated": self.config.aggregated_args}[role]

    def add_node(self, role: str, index: int | None = None) -> Child:
        index = index if index is not None else sum(1 for n in self.nodes
                                                    if n.name.startswith(role))
        name = f"{role}-{index}"
        ready = self.run_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        child = Child(name, self._node_cmd(role, name, ready), self.run_dir / f"{name}.log",
                      ready, role=role).start(self.env)
        self.nodes.append(child)
        if self.supervisor is not None:
            self.supervisor.watch_node(child)
        return child

    def restart_node(self, child: Child) -> None:
        """The same node id on a fresh port (the old one may be taken by now); the router
        learns the new address and incarnation from etcd."""
        child.ready_file.unlink(missing_ok=True)
        child.cmd = self._node_cmd(child.role, child.name, child.ready_file)
        with open(child.log_path, "ab") as log:
            log.write(f"\n--- pdserve up: restarting {child.name} ---\n".encode())
        child.start(self.env, append=True)

    def add_router(self, http_port: int, grpc_port: int, name: str = "router") -> Child:
        ready = self.run_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        cmd = self._cli("router", "--http", f"127.0.0.1:{http_port}", "--grpc",
                        f"127.0.0.1:{grpc_port}", "--etcd", self.etcd.endpoint, "--cluster",
                        self.config.cluster, "--model", self.config.model, "--ready-file",
                        str(ready), *self.tls_flags(name), *self.config.router_args)
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
        """The router's /health turns 200 once it can serve: it knows a prefill and a
        decode node, or an aggregated node."""
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
            for _ in range(c.num_aggregated):
                self.add_node("aggregated")
            self.router = self.add_router(c.http_port, c.grpc_port)
            self.wait_ready(self.nodes + [self.router], timeout)
            addresses = json.loads(self.router.ready())
            self.http_url, self.grpc_address = addresses["http"], addresses["grpc"]
            self.wait_healthy(self.http_url, timeout)
        except BaseException:
            self.stop()
            raise
        if c.restart_nodes:
            self._supervise()
        return self

    def _supervise(self) -> None:
        from launch.supervisor import Supervisor

        self.supervisor = Supervisor(self.restart_node, notify=lambda m: self.notify(m))
        self._etcd_child = Child("etcd", [], self.etcd.log_path, proc=self.etcd.proc)
        for child in (self._etcd_child, self.router):
            self.supervisor.watch_essential(child)
        for node in self.nodes:
            self.supervisor.watch_node(node)

    def supervise(self) -> list[Child]:
        """One supervision round, for the owner's loop (`pdserve up`): restart the crashed
        nodes whose backoff is over, then return the children whose loss ends the cluster
        (the router, etcd, a crash-looping node); empty while it can go on. Without a
        supervisor (`restart_nodes=False`, or before start() succeeded) nothing is restarted
        and every child that is not running ends it: `dead_children()`."""
        if self.supervisor is not None:
            return self.supervisor.poll()
        return self.dead_children()

    def start_again(self, child: Child) -> None:
        """Start a node that stopped on purpose (drained by SIGTERM, exit 0: the supervisor
        leaves those stopped) again, supervised: the second half of a rolling restart."""
        self.restart_node(child)
        if self.supervisor is not None:
            self.supervisor.watch_node(child)

    def stop_etcd(self) -> None:
        """Stop etcd on purpose (maintenance, a fault drill): supervision does not count it
        dead; nodes and routers keep serving on what they know. `start_etcd` brings it
        back on the same port and data."""
        if self.supervisor is not None and self._etcd_child is not None:
            self.supervisor.unwatch_essential(self._etcd_child)
        self.etcd.stop()

    def start_etcd(self, timeout: float = 20.0) -> None:
        self.etcd.start(timeout)
        if self.supervisor is not None and self._etcd_child is not None:
            self._etcd_child.proc = self.etcd.proc
            self.supervisor.watch_essential(self._etcd_child)

    def dead_children(self) -> list[Child]:
        """Every node or router process that is not running. Only reports: a node killed on
        purpose (fault tests) stays dead, whether or not the cluster is supervised."""
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
