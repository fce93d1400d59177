"""A decode node's parts, wired: engine + KvReceiver + token streams + engine loop + service.

The same wiring with role "aggregated" is an aggregated node: the service then prefills
requests itself (decode_node/self_prefill.py) and takes no reservations."""

from __future__ import annotations

from pathlib import Path

from cluster.core_share import CoreShare
from cluster.discovery import NodeLoad
from cluster.engine_loop import DEFAULT_ADMIT_WINDOW, PREFILL_ADMIT_WINDOW, EngineLoop
from cluster.kv_transfer.kv_receiver import KvReceiver
from cluster.kv_transfer.limits import TcpLimits
from cluster.node_metrics import NodeMetrics
from cluster.tls import TlsConfig
from decode_node.service import DecodeService, default_max_grpc_pushes
from decode_node.streams import StreamTable
from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.pd_fingerprint import engine_fingerprint
from protos import node_pb2_grpc


class DecodeNode:
    SERVICE = "pdserve.v1.DecodeNode"
    add_to_server = staticmethod(node_pb2_grpc.add_DecodeNodeServicer_to_server)

    def __init__(self, config: EngineConfig, node_id: str = "decode", lease_s: float = 30.0,
                 kv_tcp_listen: str | None = None, max_lease_s: float | None = None,
                 kv_tcp_limits: TcpLimits | None = None, tls: TlsConfig | None = None,
                 max_grpc_pushes: int | None = None, role: str = "decode",
                 core_share: CoreShare | None = None, kv_local_socket: bool = True):
        """lease_s: the default reservation lease; max_lease_s: the longest a caller may
        ask for (default lease_s: `--lease-s` is the ceiling too). kv_tcp_limits: the raw-TCP
        data plane's connection cap and timeouts. tls: the data plane speaks mutual TLS
        (the gRPC server's TLS is GrpcNodeServer's). max_grpc_pushes: PushKv streams served
        at once (None: default_max_grpc_pushes of the engine's max_num_seqs). role:
        "decode", or "aggregated" (prefills by itself; no KV data plane needed).
        kv_local_socket: the data plane also listens on a Unix socket for prefill nodes on
        this host (cluster/kv_transfer/local_socket.py). core_share:
        the turn on cores shared with other nodes (cluster/core_share.py)."""
        self.engine = LLMEngine(config)
        self.fingerprint = engine_fingerprint(self.engine)
        self.receiver = KvReceiver(self.engine, lease_s, max_lease_s=max_lease_s)
        self.streams = StreamTable()
        # an aggregated node takes no reservations: no reservation metrics
        self.metrics = NodeMetrics(role, node_id, self.engine,
                                   receiver=self.receiver if role == "decode" else None,
                                   core_share=core_share)
        # an aggregated node prefills the router's requests itself: a burst of them shares
        # its first step as on a prefill node; a decode node's arrivals are pushes whose
        # first tokens should leave at once
        window = PREFILL_ADMIT_WINDOW if role == "aggregated" else DEFAULT_ADMIT_WINDOW
        self.loop = EngineLoop(self.engine, outbox=self.streams.deliver, name="decode",
                               observer=self.metrics.observer, step_gate=core_share,
                               admit_window=window)
        if max_grpc_pushes is None:
            max_grpc_pushes = default_max_grpc_pushes(config.max_num_seqs)
        self.service = DecodeService(self.engine, self.receiver, self.streams, self.fingerprint,
                                     node_id=node_id, model_id=Path(config.model).name,
                                     max_grpc_pushes=max_grpc_pushes, role=role,
                                     metrics=self.metrics)
        self.kv_tcp_listen = kv_tcp_listen      # HOST:PORT of the raw-TCP data plane
        self.kv_tcp_limits = kv_tcp_limits or TcpLimits()
        self.tls = tls
        self.kv_local_socket = kv_local_socket
        self.kv_tcp = None

    def start(self, advertise_host: str | None = None) -> None:
        """Call from the event loop that serves the service."""
        self.service.start()
        self.loop.start()
        if self.kv_tcp_listen:
            from cluster.kv_transfer.tcp_server import TcpKvServer
            host, _, port = self.kv_tcp_listen.rpartition(":")
            self.kv_tcp = TcpKvServer(self.service.push_handler, host.strip("[]"), int(port),
                                      limits=self.kv_tcp_limits, tls=self.tls,
                                      local=self.kv_local_socket)
            self.kv_tcp.start()
            self.service.kv_tcp_address = self.kv_tcp.address(advertise_host)
            self.service.kv_local_socket = self.kv_tcp.local_path

    def begin_drain(self) -> None:
        self.service.begin_drain()

    async def stop(self) -> None:
        if self.kv_tcp is not None:
            await self.kv_tcp.stop()
        await self.service.stop()
        self.loop.stop()

    def load(self) -> NodeLoad:
        load = self.engine.load()
        return NodeLoad(running=load.running, waiting=load.waiting,
                        free_blocks=load.free_blocks, total_blocks=load.total_blocks,
                        reserved=len(self.receiver.reservations),
                        block_hashes=load.block_hashes)
