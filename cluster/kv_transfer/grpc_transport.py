"""Default transport: gRPC client-streaming of raw KV bytes (DecodeNode.PushKv)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from cluster.kv_transfer.base import GRPC_OPTIONS, KvTransport, PushFailed
from cluster.rpc_status import DECODE, failure_of
from cluster.tls import TlsConfig
from protos import node_pb2, node_pb2_grpc

log = logging.getLogger("cluster.kv_transfer")


def open_channel(address: str, tls: TlsConfig | None,
                 options: list | None = None) -> grpc.aio.Channel:
    """A channel to a node: plaintext, or mutual TLS checked against the cluster CA."""
    options = list(GRPC_OPTIONS if options is None else options)
    if tls is None:
        return grpc.aio.insecure_channel(address, options)
    return grpc.aio.secure_channel(address, tls.grpc_channel_credentials(),
                                   options + tls.grpc_channel_options())


class GrpcTransport(KvTransport):
    def __init__(self, timeout: float = 120.0, tls: TlsConfig | None = None):
        """tls: dial decode nodes with the cluster's mutual TLS."""
        self.timeout = timeout
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> node_pb2_grpc.DecodeNodeStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self.tls)
        return node_pb2_grpc.DecodeNodeStub(channel)

    async def push(self, address: str,
                   messages: AsyncIterator[node_pb2.KvPushMessage]) -> node_pb2.PushAck:
        try:
            return await self._stub(address).PushKv(messages, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            failure = failure_of(exc, DECODE)
            raise PushFailed(failure.code, failure.message, failure.side) from None

    async def abort_reservation(self, address: str, request: node_pb2.AbortRequest) -> bool:
        try:
            reply = await self._stub(address).AbortReservation(request, timeout=5.0)
            return reply.found
        except grpc.aio.AioRpcError as exc:
            log.warning("request %s: abort notice to %s failed: %s", request.request_id,
                        address, exc.code().name)
            return False

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
