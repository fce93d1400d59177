"""A prefill node's parts, wired: engine with the KV push connector + engine loop +
transport + service."""

from __future__ import annotations

from pathlib import Path

from cluster.discovery import NodeLoad
from cluster.engine_loop import EngineLoop
from cluster.kv_transfer.base import DEFAULT_CHUNK_BYTES, KvTransport
from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.pd_fingerprint import engine_fingerprint
from engine.pd_prefill import KvPushConnector
from prefill_node.service import PrefillService
from protos import node_pb2_grpc


class PrefillNode:
    SERVICE = "pdserve.v1.PrefillNode"
    add_to_server = staticmethod(node_pb2_grpc.add_PrefillNodeServicer_to_server)

    def __init__(self, config: EngineConfig, transport: KvTransport, node_id: str = "prefill",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.engine = LLMEngine(config, connector=KvPushConnector)
        self.fingerprint = engine_fingerprint(self.engine)
        self.transport = transport
        self.loop = EngineLoop(self.engine, name="prefill")
        self.service = PrefillService(self.engine, transport, self.fingerprint,
                                      node_id=node_id, model_id=Path(config.model).name,
                                      chunk_bytes=chunk_bytes)

    def start(self, advertise_host: str | None = None) -> None:
        self.loop.start()

    def begin_drain(self) -> None:
        self.service.draining = True

    async def stop(self) -> None:
        self.loop.stop()
        await self.transport.close()

    def load(self) -> NodeLoad:
        load = self.engine.load()
        return NodeLoad(running=load.running, waiting=load.waiting,
                        free_blocks=load.free_blocks, total_blocks=load.total_blocks,
                        block_hashes=load.block_hashes)
