"""What the router's backends share about calling nodes: one gRPC channel per node
address, and how a node call's failure is read (cluster/rpc_status.py trailers -> try
another unit, a node failure to replay, or the client's error).

Used by the PD flow (router/pd_backend.py) and the aggregated flow
(router/aggregated_flow.py) alike, so both classify a node's answer the same way.
"""

from __future__ import annotations

import grpc

from cluster.kv_transfer.grpc_transport import open_channel
from cluster.proto_convert import logprobs_from_proto
from cluster.rpc_status import RpcFailure
from cluster.tls import TlsConfig
from engine.sampling_params import SamplingParams
from router.backend import StepOutput
from router.errors import InvalidRequest, NodeFailure, RouterError
from router.node_pool import NodeState

# Codes that say the node, not the request, is the problem: drop it and replay elsewhere.
_NODE_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.DEADLINE_EXCEEDED}
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.max_send_message_length", 64 * 1024 * 1024)]


class TryOther(Exception):
    """This unit (a pair, or an aggregated node) cannot take the request (full,
    incompatible, aborted, draining); try another one. The node stays in the pool."""

    def __init__(self, node: NodeState, code: grpc.StatusCode, message: str,
                 replay: bool = False):
        super().__init__(message)
        self.node_id, self.role, self.code, self.message = node.node_id, node.role, code, message
        # the node asked for a replay elsewhere (draining, a lease that ran out): a passing
        # state of that node, never the request's own fault
        self.replay = replay

    @property
    def may_pass(self) -> bool:
        """Whether the same refusal can go away by itself: the node is full, asked for a
        replay, or its discovery view does not hold the peer yet (PERMISSION_DENIED)."""
        return self.replay or self.code in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            grpc.StatusCode.PERMISSION_DENIED)


class ChannelCache:
    """One channel per node address. A failed node's channel is closed only once no call
    uses it: closing a grpc.aio channel cancels every call on it, and a node that refuses
    one request (or is draining) still serves the streams it has."""

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self.tls = tls                        # mutual TLS to the nodes (cluster/tls.py)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._users: dict[str, int] = {}
        self._retired: set[str] = set()

    def acquire(self, address: str) -> grpc.aio.Channel:
        self._users[address] = self._users.get(address, 0) + 1
        return self.get(address)

    async def release(self, address: str) -> None:
        self._users[address] -= 1
        if not self._users[address]:
            del self._users[address]
            if address in self._retired:
                await self.drop(address)

    async def retire(self, address: str) -> None:
        """Close the channel once its last call ends (now, when none is running)."""
        if self._users.get(address):
            self._retired.add(address)
        else:
            await self.drop(address)

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(address, self.tls, _CHANNEL_OPTIONS)
        return ch

    async def drop(self, address: str) -> None:
        self._retired.discard(address)
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close(grace=None)

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)


def stop_reason_from_wire(value: str, params: SamplingParams) -> int | str | None:
    """The wire carries a string; a stop token id goes back to an int (as LLM gives it)."""
    if not value:
        return None
    if value not in params.stop and value.isdigit():
        return int(value)
    return value


def classify_failure(failure: RpcFailure, node: NodeState) -> Exception:
    code, message = failure.code, failure.message
    if failure.replay:               # the node is fine but will not run this request
        return TryOther(node, code, message, replay=True)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(message)
    # PERMISSION_DENIED: e.g. a prefill node whose discovery view does not (yet) hold the
    # decode node. INTERNAL / UNKNOWN: a call or push broken inside gRPC or a node (seen:
    # a push into a decode node as it drained). Another pair may well serve, and the
    # client should get its tokens, not a 500; attempts stay bounded by max_attempts.
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INTERNAL,
                grpc.StatusCode.UNKNOWN):
        return TryOther(node, code, message)
    if code in _NODE_DOWN:
        return NodeFailure(node.node_id, f"{code.name}: {message}")
    return RouterError(f"{node.role} node {node.node_id} failed: {code.name}: {message}")


def token_step(t, finish: str | None, params: SamplingParams, original: SamplingParams,
               cached: int, first_attempt: bool, meta: dict, skip: int = 0) -> StepOutput:
    """A node's TokenEvent `t` (finish already decoded) as the router's StepOutput; the
    same for a decode node's and an aggregated node's stream. skip: leading tokens (and
    their logprobs) already streamed (the prefill node's first token)."""
    return StepOutput(
        list(t.token_ids)[skip:],
        logprobs_from_proto(t.logprobs)[skip:] if original.logprobs is not None else None,
        finish_reason=finish,
        stop_reason=stop_reason_from_wire(t.stop_reason, params) if finish else None,
        num_cached_tokens=cached if first_attempt else 0,
        meta=meta)
