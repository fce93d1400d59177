"""A prefill node's parts, wired: engine with the KV push connector + engine loop +
transport + service."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cluster.core_share import CoreShare
from cluster.discovery import NodeLoad
from cluster.engine_loop import PREFILL_ADMIT_WINDOW, EngineLoop
from cluster.kv_transfer.base import DEFAULT_CHUNK_BYTES, KvTransport
from cluster.kv_transfer.handoff import TurnHandoffs
from cluster.node_metrics import NodeMetrics
from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.pd_fingerprint import engine_fingerprint
from engine.pd_prefill import KvPushConnector
from prefill_node.decode_gate import DecodeGate, OpenDecodeGate, start_gate
from prefill_node.service import PrefillService
from protos import node_pb2_grpc


class PrefillNode:
    SERVICE = "pdserve.v1.PrefillNode"
    add_to_server = staticmethod(node_pb2_grpc.add_PrefillNodeServicer_to_server)

    def __init__(self, config: EngineConfig, transport: KvTransport, node_id: str = "prefill",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, decode_gate: DecodeGate | None = None,
                 core_share: CoreShare | None = None, kv_push: str = "auto"):
        """decode_gate: which decode addresses a Prefill call may name (default: any, with
        a warning at start; prefill_node/decode_gate.py). core_share: the turn on cores
        shared with other nodes (cluster/core_share.py). kv_push: `layer` (each layer's KV
        leaves as the forward writes it, overlapping the compute), `step` (a step's layers
        leave together after its forward) or `auto`: `step` on a CPU, `layer` elsewhere.
        Why: on a CPU the threads that send a layer need the very cores the forward's
        OpenMP team computes on, and each layer's wake-up preempts a thread of that team,
        which stalls it at the next barrier; measured (2 cores, bf16, 256-token prompts):
        the prefill step took 265-320 ms with a per-layer push, 205-250 with `step`, about
        what it takes with no push. On an accelerator the copies are asynchronous and the
        overlap is free."""
        self.engine = LLMEngine(config, connector=KvPushConnector)
        if kv_push not in ("auto", "layer", "step"):
            raise ValueError(f"kv_push must be auto, layer or step, got {kv_push!r}")
        per_layer = kv_push == "layer" or (kv_push == "auto"
                                           and not self.engine.device.is_cpu)
        self.decode_gate = decode_gate or OpenDecodeGate()
        self._gate_start: asyncio.Task | None = None
        self.fingerprint = engine_fingerprint(self.engine)
        self.transport = transport
        # on shared cores a step's pushes are delivered in the node's own turn
        self.handoffs = TurnHandoffs() if core_share is not None and not per_layer else None
        self.metrics = NodeMetrics("prefill", node_id, self.engine, core_share=core_share,
                                   handoffs=self.handoffs)
        self.loop = EngineLoop(self.engine, name="prefill", observer=self.metrics.observer,
                               admit_window=PREFILL_ADMIT_WINDOW,
                               step_gate=core_share,
                               before_release=self.handoffs.wait if self.handoffs else None)
        self.service = PrefillService(self.engine, transport, self.fingerprint,
                                      node_id=node_id, model_id=Path(config.model).name,
                                      chunk_bytes=chunk_bytes, decode_gate=self.decode_gate,
                                      metrics=self.metrics, push_per_layer=per_layer,
                                      handoffs=self.handoffs)

    def start(self, advertise_host: str | None = None) -> None:
        """Call from the event loop that serves the service."""
        self.loop.start()
        self._gate_start = asyncio.get_running_loop().create_task(start_gate(self.decode_gate))

    def begin_drain(self) -> None:
        self.service.draining = True

    async def stop(self) -> None:
        self.loop.stop()
        if self._gate_start is not None:
            await asyncio.gather(self._gate_start, return_exceptions=True)
        await self.decode_gate.close()
        await self.transport.close()

    def load(self) -> NodeLoad:
        load = self.engine.load()
        return NodeLoad(running=load.running, waiting=load.waiting,
                        free_blocks=load.free_blocks, total_blocks=load.total_blocks,
                        block_hashes=load.block_hashes)
