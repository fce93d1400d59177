"""In-process fake transport for unit tests: hands the messages straight to the decode
side's PushHandler (no sockets, no serialization), so tests exercise the same protocol
and validation as the gRPC transport."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from cluster.kv_transfer.base import KvTransport, PushFailed
from cluster.kv_transfer.receiver import PushHandler
from protos import node_pb2


class InProcessTransport(KvTransport):
    def __init__(self) -> None:
        self.handlers: dict[str, PushHandler] = {}
        self.aborts: list[node_pb2.AbortRequest] = []
        self.on_abort = None       # async (AbortRequest) -> bool, set by the decode side

    def attach(self, address: str, handler: PushHandler, on_abort=None) -> None:
        self.handlers[address] = handler
        if on_abort is not None:
            self.on_abort = on_abort

    async def push(self, address: str,
                   messages: AsyncIterator[node_pb2.KvPushMessage]) -> node_pb2.PushAck:
        handler = self.handlers.get(address)
        if handler is None:
            raise PushFailed(grpc.StatusCode.UNAVAILABLE, f"no decode node at {address}")
        return await handler.handle(messages)

    async def abort_reservation(self, address: str, request: node_pb2.AbortRequest) -> bool:
        self.aborts.append(request)
        return bool(await self.on_abort(request)) if self.on_abort is not None else False
