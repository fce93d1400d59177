"""Assembles and runs one router: discovery watch -> node pool -> policy -> PD backend ->
HTTP + gRPC fronts. Stateless: everything it knows comes from discovery, so any number of
routers can serve one cluster."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from cluster.discovery.etcd_access import EtcdAccess
from cluster.gc_pause import freeze_startup_objects
from cluster.tls import TlsConfig
from router.public_tls import PublicTls
from router.rate_limit import RateLimit, RateLimiter

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True)
class RouterConfig:
    model: str                                  # HF folder: tokenizer, chat template, limits
    served_model_name: str | None = None        # default: the folder's name
    http_listen: str = "127.0.0.1:8000"
    grpc_listen: str = "127.0.0.1:50051"
    etcd: str = "127.0.0.1:2379"                # HOST:PORT[,HOST:PORT...]
    cluster: str = "default"
    policy: str = "prefix-cache-aware"
    max_model_len: int | None = None
    lease_ms: int = 30_000                      # decode-side reservation lease
    max_attempts: int = 4                       # pairs tried per request (replays included)
    stall_timeout_s: float = 60.0               # silent decode node (prefill done) -> replay
    queue_timeout_s: float = 30.0               # every decode node full: wait, then 429
    queue_depth: int = 1000                     # waiting requests beyond this: 429 at once
    ready_file: str | None = None               # JSON {"http": url, "grpc": addr} once serving
    drain_timeout: float = 30.0
    # The public edge (docs/SECURITY.md): keys clients must send (none: open), /metrics on
    # the HTTP port, gRPC server reflection (off: it describes the API to anyone).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    rate_limit: RateLimit | None = None         # per key (router/rate_limit.py); None: off
    metrics: bool = True
    grpc_reflection: bool = False
    # Mutual TLS to the nodes (cluster/tls.py; None: plaintext); TLS and credentials for
    # etcd (cluster/discovery/etcd_access.py; None: plaintext, no auth).
    tls: TlsConfig | None = None
    etcd_access: EtcdAccess | None = None
    # TLS on the public HTTP and gRPC listeners (router/public_tls.py; None: plaintext)
    public_tls: PublicTls | None = None

    def __post_init__(self):
        from router.policies import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of "
                             f"{', '.join(sorted(POLICIES))}")
        for name in ("http_listen", "grpc_listen"):
            host, _, port = getattr(self, name).rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"{name} must be HOST:PORT, got {getattr(self, name)!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not self.queue_timeout_s >= 0:
            raise ValueError(f"queue_timeout_s must be >= 0, got {self.queue_timeout_s}")
        if self.queue_depth < 0:
            raise ValueError(f"queue_depth must be >= 0, got {self.queue_depth}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        if self.lease_ms < 1000:
            raise ValueError(f"lease_ms must be >= 1000, got {self.lease_ms}")
        from router.auth import ApiKeys

        if self.rate_limit is not None and not ApiKeys(self.api_keys):
            raise ValueError("--rate-limit needs --api-key: the limit is counted per key")
        ApiKeys(self.api_keys)                  # ValueError naming what is wrong with a key


class Router:
    """A running router; `start()` binds both ports, `stop()` drains and closes."""

    def __init__(self, config: RouterConfig, registry=None):
        from router.auth import ApiKeys
        from router.http_server import make_app
        from router.metrics import RouterMetrics
        from router.model_info import ModelInfo, load_tokenizer
        from router.node_pool import NodePool
        from router.pd_backend import PdBackend
        from router.policies import make_policy
        from router.service import RouterService

        self.config = config
        self.info = ModelInfo.from_folder(config.model, config.served_model_name,
                                          config.max_model_len)
        self.pool = NodePool()
        self.metrics = RouterMetrics(self.pool)
        self.backend = PdBackend(self.pool, make_policy(config.policy), self.metrics,
                                 max_model_len=self.info.max_model_len,
                                 lease_ms=config.lease_ms, max_attempts=config.max_attempts,
                                 stall_timeout_s=config.stall_timeout_s,
                                 queue_timeout_s=config.queue_timeout_s,
                                 queue_depth=config.queue_depth, tls=config.tls)
        self.service = RouterService(self.info, load_tokenizer(self.info), self.backend,
                                     self.metrics)
        if registry is None:
            from cluster.discovery import EtcdRegistry
            registry = EtcdRegistry(config.etcd, cluster=config.cluster,
                                    access=config.etcd_access)
        self.registry = registry
        self.api_keys = ApiKeys(config.api_keys)
        self.limiter = RateLimiter(config.rate_limit) if config.rate_limit else None
        self.app = make_app(self.service, api_keys=self.api_keys, metrics_on=config.metrics,
                            limiter=self.limiter)
        self._runner = None
        self._grpc = None
        self._feed: asyncio.Task | None = None
        self.http_url = ""
        self.grpc_address = ""

    async def start(self) -> None:
        from aiohttp import web

        from router.discovery_feed import follow
        from router.grpc_server import GrpcFront

        start = getattr(self.registry, "start", None)     # optional in the interface
        if start is not None:
            await start()
        self._feed = asyncio.create_task(follow(self.registry, self.pool))
        # handler_cancellation: a client that hangs up aborts its request on the nodes.
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        host, _, port = self.config.http_listen.rpartition(":")
        tls = self.config.public_tls
        site = web.TCPSite(self._runner, host, int(port),
                           ssl_context=tls.ssl_context() if tls is not None else None)
        await site.start()
        bound = self._runner.addresses[0][1]                  # port 0: the one chosen
        self.http_url = f"{'https' if tls is not None else 'http'}://{host}:{bound}"
        self._grpc = GrpcFront(self.service, self.config.grpc_listen, api_keys=self.api_keys,
                               reflection_on=self.config.grpc_reflection, public_tls=tls,
                               limiter=self.limiter)
        await self._grpc.start()
        ghost = self.config.grpc_listen.rpartition(":")[0]
        self.grpc_address = f"{ghost}:{self._grpc.port}"
        log.info("router serving %r: HTTP %s, gRPC %s, policy %s, cluster %r, API key %s, "
                 "rate limit %s", self.info.name, self.http_url, self.grpc_address,
                 self.config.policy, self.config.cluster,
                 f"required ({len(self.api_keys)} configured)" if self.api_keys else "not required",
                 f"{self.config.rate_limit} per key" if self.config.rate_limit else "none")
        if self.config.ready_file:
            path = Path(self.config.ready_file)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps({"http": self.http_url, "grpc": self.grpc_address}))
            tmp.replace(path)

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=self.config.drain_timeout)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._feed is not None:
            self._feed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._feed
        await self.backend.close()
        await self.registry.close()


async def serve(config: RouterConfig) -> None:
    """Run until SIGTERM / SIGINT, then stop taking requests and finish those in flight."""
    router = Router(config)
    freeze_startup_objects()     # full GC passes skip the tokenizer and imports (gc_pause.py)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await router.start()
    try:
        await stop.wait()
        log.info("router stopping")
    finally:
        await router.stop()
