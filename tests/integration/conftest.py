"""Integration fixtures: a real etcd on 127.0.0.1 (random ports, stopped by PID), helpers
to start pdserve node processes and stop them with SIGTERM, and the router tests' tiny
model folder (`folder`) with its single-node reference LLM (`llm`), once per module (a
module may define its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.etcd_server import EtcdServer, free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.integration.router_harness import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def llm(folder):
    from engine import LLM
    from tests.integration.router_harness import ENGINE

    return LLM(folder, **ENGINE)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.stop()


class NodeProcess:
    def __init__(self, role: str, args: list[str], tmp: Path, env: dict | None = None):
        self.role = role
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.ready_file = tmp / f"{role}-{self.port}.ready"
        self.log_path = tmp / f"{role}-{self.port}.log"
        cmd = [sys.executable, "-m", "launch.cli", role, "--listen", self.address,
               "--ready-file", str(self.ready_file), *args]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log,
                                         stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} node exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            if self.ready_file.exists() and self.ready_file.read_text().strip():
                return self.ready_file.read_text().strip()
            time.sleep(0.1)
        raise TimeoutError(f"{self.role} node not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def start_node(tmp_path: Path):
    started: list[NodeProcess] = []

    def _start(role: str, *args: str, env: dict | None = None) -> NodeProcess:
        node = NodeProcess(role, list(args), tmp_path, env)
        started.append(node)
        return node

    yield _start
    for node in started:
        node.kill()
