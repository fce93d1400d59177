"""The KV transport interface: move one push (a stream of KvPushMessage) to a decode node.

A transport only moves messages; what they mean (header, layer chunks, done) is built by
cluster/kv_transfer/sender.py and checked by cluster/kv_transfer/receiver.py, so every
transport (gRPC streaming, the in-process fake, later shared memory or RDMA) carries the
same protocol and the same validation.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator

import grpc

from protos import node_pb2

# Chunks stay well under the 16 MiB message limit the nodes configure.
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 16 << 20
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


class PushFailed(Exception):
    """The decode node refused or broke the push; `code` is a grpc.StatusCode. A push
    failure is the decode side's (its refusal, or the link to it) unless said otherwise."""

    def __init__(self, code: grpc.StatusCode, message: str, side: str = "decode"):
        super().__init__(message)
        self.code = code
        self.message = message
        self.side = side

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class KvTransport(abc.ABC):
    @abc.abstractmethod
    async def push(self, address: str,
                   messages: AsyncIterator[node_pb2.KvPushMessage]) -> node_pb2.PushAck:
        """Deliver the messages to the decode node at `address`; raise PushFailed."""

    @abc.abstractmethod
    async def abort_reservation(self, address: str, request: node_pb2.AbortRequest) -> bool:
        """Failure notice to the decode node (best effort); True when it knew the request."""

    async def close(self) -> None:
        return None
