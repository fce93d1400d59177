"""What every pdserve gRPC server shares: an aio server with health (grpc.health.v1) and
reflection, bound to a listen address; discovery registration with load publishing; and
the SIGTERM drain (health NOT_SERVING, deregister, finish in-flight work, stop)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.discovery import NodeLoad, NodeRecord, Registry
from cluster.kv_transfer.base import GRPC_OPTIONS
from cluster.tls import TlsConfig

log = logging.getLogger("cluster.node")


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def advertised(listen: str, bound_port: int, advertise: str | None) -> str:
    if advertise:
        split_host_port(advertise)
        return advertise
    host, _ = split_host_port(listen)
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1" if host == "" or host == "0.0.0.0" else "::1"
    return f"{host}:{bound_port}"


class GrpcNodeServer:
    """One gRPC server for one service, with health, reflection and the drain protocol."""

    def __init__(self, service_full_name: str, listen: str, tls: TlsConfig | None = None):
        """tls: mutual TLS (clients must show a certificate of the cluster CA)."""
        self.service_name = service_full_name
        self.listen = listen
        self.tls = tls
        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0

    def add(self, add_to_server: Callable, servicer) -> None:
        add_to_server(servicer, self.server)

    async def start(self) -> int:
        reflection.enable_server_reflection(
            [self.service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        try:
            if self.tls is None:
                self.port = self.server.add_insecure_port(self.listen)
            else:
                self.port = self.server.add_secure_port(self.listen,
                                                        self.tls.grpc_server_credentials())
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {self.listen}: {exc}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {self.listen} (in use or not a local address?)")
        await self.server.start()
        await self.set_serving(False)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("", status)
        await self.health.set(self.service_name, status)

    async def stop(self, grace: float = 2.0) -> None:
        await self.server.stop(grace)


class Presence:
    """Registration + periodic load publishing in discovery (None registry: standalone)."""

    def __init__(self, registry: Registry | None, record: NodeRecord,
                 load_fn: Callable[[], NodeLoad], interval: float):
        self.registry = registry
        self.record = record
        self.load_fn = load_fn
        self.interval = interval
        self._task: asyncio.Task | None = None

    async def start(self, wait_s: float) -> None:
        if self.registry is None:
            return
        await self.registry.publish_load(self.load_fn())
        await self.registry.register(self.record)
        wait = getattr(self.registry, "wait_registered", None)
        if wait is not None and not await wait(wait_s):
            log.warning("not yet registered in discovery after %.0fs; serving anyway and "
                        "retrying in the background", wait_s)
        self._task = asyncio.create_task(self._publish(), name="load-publisher")

    async def _publish(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.registry.publish_load(self.load_fn())
            except Exception as exc:  # noqa: BLE001 - never let load publishing kill a node
                log.debug("load publish failed: %s", exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.registry is not None:
            await self.registry.deregister()
            await self.registry.close()


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def drain(in_flight: Callable[[], int], timeout: float, what: str) -> None:
    """Wait until nothing is in flight (or the timeout), logging what is left."""
    deadline = asyncio.get_running_loop().time() + timeout
    while in_flight() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    left = in_flight()
    if left:
        log.warning("%s: drain timeout with %d request(s) still in flight", what, left)
    else:
        log.info("%s: drained", what)


def write_ready_file(path: str | None, address: str) -> None:
    if path:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(address + "\n")
        tmp.replace(path)


def default_node_id(role: str) -> str:
    import os
    return f"{role}-{socket.gethostname()}-{os.getpid()}"
