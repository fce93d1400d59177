"""A prefill node's parts, wired: PD prefill engine + engine loop + transport + service."""

from __future__ import annotations

import threading
from pathlib import Path

from cluster.discovery import NodeLoad
from cluster.engine_loop import EngineLoop
from cluster.kv_transfer.base import DEFAULT_CHUNK_BYTES, KvTransport
from engine.config import EngineConfig
from engine.pd_fingerprint import engine_fingerprint
from engine.pd_prefill import PdPrefillEngine
from prefill_node.service import PrefillService
from protos import node_pb2_grpc

MAX_PUBLISHED_HASHES = 4096


class PrefillNode:
    SERVICE = "pdserve.v1.PrefillNode"
    add_to_server = staticmethod(node_pb2_grpc.add_PrefillNodeServicer_to_server)

    def __init__(self, config: EngineConfig, transport: KvTransport, node_id: str = "prefill",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.engine = PdPrefillEngine(config)
        self.fingerprint = engine_fingerprint(self.engine)
        self.lock = threading.RLock()
        self.transport = transport
        self.loop = EngineLoop(self.engine, self.lock,
                               after_step=self.engine.reap_finished_jobs, name="prefill")
        self.service = PrefillService(self.engine, self.lock, self.loop.wake, transport,
                                      self.fingerprint, node_id=node_id,
                                      model_id=Path(config.model).name, chunk_bytes=chunk_bytes)

    def start(self, advertise_host: str | None = None) -> None:
        self.loop.start()

    async def stop(self) -> None:
        self.loop.stop()
        await self.transport.close()

    def load(self) -> NodeLoad:
        eng, bm = self.engine, self.engine.block_manager
        return NodeLoad(running=len(eng.scheduler.running), waiting=len(eng.scheduler.waiting),
                        free_blocks=bm.num_free_blocks, total_blocks=bm.num_blocks - 1,
                        block_hashes=tuple(bm.cached_block_hashes()[:MAX_PUBLISHED_HASHES]))
