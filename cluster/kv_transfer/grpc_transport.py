"""Default transport: gRPC client-streaming of raw KV bytes (DecodeNode.PushKv)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

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


# A decode address unused this long loses its channel: a decode node restarts on a fresh
# port (pdserve up) or gets a new pod IP, so a long-lived prefill node would otherwise keep
# one channel per decode incarnation it ever pushed to.
IDLE_CHANNEL_S = 300.0


class GrpcTransport(KvTransport):
    def __init__(self, timeout: float = 120.0, tls: TlsConfig | None = None,
                 idle_channel_s: float = IDLE_CHANNEL_S,
                 clock: Callable[[], float] = time.monotonic):
        """tls: dial decode nodes with the cluster's mutual TLS."""
        self.timeout = timeout
        self.tls = tls
        self.idle_channel_s = idle_channel_s
        self.clock = clock
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._last_used: dict[str, float] = {}
        self._calls: dict[str, int] = {}        # calls running on each channel

    def _stub(self, address: str) -> node_pb2_grpc.DecodeNodeStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self.tls)
        self._last_used[address] = self.clock()
        return node_pb2_grpc.DecodeNodeStub(channel)

    @contextlib.asynccontextmanager
    async def _using(self, address: str):
        """A call on `address`'s channel: idle channels are closed first, never this one
        or one with a call running (closing a channel cancels its calls)."""
        await self.close_idle()
        self._calls[address] = self._calls.get(address, 0) + 1
        try:
            yield self._stub(address)
        finally:
            self._calls[address] -= 1
            if not self._calls[address]:
                del self._calls[address]
            self._last_used[address] = self.clock()

    def has_channel(self, address: str) -> bool:
        return address in self._channels

    async def close_idle(self) -> list[str]:
        """Close the channels unused for `idle_channel_s` with no call running."""
        now = self.clock()
        idle = [a for a, t in self._last_used.items()
                if now - t > self.idle_channel_s and not self._calls.get(a)]
        for address in idle:
            del self._last_used[address]
            channel = self._channels.pop(address, None)
            if channel is not None:
                await channel.close()
        return idle

    async def push(self, address: str,
                   messages: AsyncIterator[node_pb2.KvPushMessage]) -> node_pb2.PushAck:
        async with self._using(address) as stub:
            try:
                return await stub.PushKv(messages, timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                failure = failure_of(exc, DECODE)
                raise PushFailed(failure.code, failure.message, failure.side) from None

    async def abort_reservation(self, address: str, request: node_pb2.AbortRequest) -> bool:
        async with self._using(address) as stub:
            try:
                reply = await stub.AbortReservation(request, timeout=5.0)
                return reply.found
            except grpc.aio.AioRpcError as exc:
                log.warning("request %s: abort notice to %s failed: %s", request.request_id,
                            address, exc.code().name)
                return False

    async def node_info(self, address: str, timeout: float = 5.0) -> node_pb2.NodeInfo:
        async with self._using(address) as stub:
            return await stub.GetNodeInfo(node_pb2.NodeInfoRequest(), timeout=timeout)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._last_used.clear()
