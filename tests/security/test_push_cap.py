"""The cap on concurrent gRPC PushKv streams of a decode node (decode_node/service.py): a
stream costs a handler task and buffers before its header proves anything, so past
`max_grpc_pushes` a new one is answered RESOURCE_EXHAUSTED before a byte of it is read.

A real DecodeNode behind a real gRPC server on loopback: idle streams fill the cap, the
next one is refused, a slot freed by a caller that hangs up is reused, and a real Decode
whose KV is pushed over gRPC still completes (the cap counts streams, not reservations).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.kv_transfer.grpc_transport import open_channel
from cluster.node_server import GrpcNodeServer
from decode_node.node import DecodeNode
from decode_node.service import MIN_GRPC_PUSHES, default_max_grpc_pushes
from engine.config import EngineConfig
from protos import common_pb2, node_pb2, node_pb2_grpc
from tests.tiny_models import make_tiny_model

OPTS = dict(dtype="float32", block_size=4, num_gpu_blocks=64, max_num_seqs=4)
CAP = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("qwen3-qknorm-hd24", tmp_path_factory.mktemp("models"))[0]


async def _until(predicate, timeout: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate() and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return predicate()


async def _silent():
    """A push that never sends its header (until cancelled)."""
    await asyncio.Event().wait()
    yield node_pb2.KvPushMessage()          # never reached


def _push_messages(node: DecodeNode, res) -> list[node_pb2.KvPushMessage]:
    fp = node.fingerprint
    ids = list(res.block_ids)[res.num_cached_blocks:]
    shape = [len(ids), fp.block_size, fp.num_kv_heads, fp.head_dim]
    zeros = bytes(4 * shape[0] * shape[1] * shape[2] * shape[3])
    msgs = [node_pb2.KvPushMessage(header=node_pb2.PushHeader(
        request_id="r1", reservation_id=res.reservation_id, fingerprint=res.fingerprint,
        block_ids=ids, push_token=res.push_token))]
    msgs += [node_pb2.KvPushMessage(chunk=node_pb2.KvChunk(
        layer=layer, kind=kind, block_ids=ids, shape=shape, dtype="float32", data=zeros))
        for layer in range(fp.num_layers) for kind in (0, 1)]
    return msgs + [node_pb2.KvPushMessage(done=node_pb2.PushDone(
        first_token_id=5, num_chunks=len(msgs) - 1))]


async def _stream(msgs):
    for m in msgs:
        yield m


def test_pushes_past_the_cap_are_refused_and_a_real_push_still_goes_through(folder):
    async def main():
        node = DecodeNode(EngineConfig(model=str(folder), **OPTS), max_grpc_pushes=CAP)
        server = GrpcNodeServer(node.SERVICE, "127.0.0.1:0")
        server.add(node.add_to_server, node.service)
        port = await server.start()
        node.start(advertise_host="127.0.0.1")
        await server.set_serving(True)
        svc = node.service
        try:
            async with open_channel(f"127.0.0.1:{port}", None) as channel:
                stub = node_pb2_grpc.DecodeNodeStub(channel)
                idle = [stub.PushKv(_silent()) for _ in range(CAP)]
                assert await _until(lambda: svc.grpc_pushes == CAP), svc.grpc_pushes
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.PushKv(_silent(), timeout=5)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "too many KV pushes" in info.value.details()
                assert "--max-grpc-pushes" in info.value.details()
                assert svc.grpc_pushes_refused == 1 and svc.grpc_pushes == CAP
                # a caller that hangs up frees its slot
                idle.pop().cancel()
                assert await _until(lambda: svc.grpc_pushes == CAP - 1), svc.grpc_pushes
                # a real Decode whose push takes the freed slot completes
                call = stub.Decode(node_pb2.ReserveRequest(
                    request_id="r1", prompt_token_ids=[40, 41, 42, 43, 44, 45, 46],
                    sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)))
                res = (await call.read()).reservation
                ack = await stub.PushKv(_stream(_push_messages(node, res)), timeout=30)
                assert ack.num_chunks > 0
                tokens = []
                while (event := await call.read()) is not grpc.aio.EOF:
                    tokens += event.tokens.token_ids
                assert tokens[0] == 5 and len(tokens) == 4
                assert svc.grpc_pushes_refused == 1
                for call in idle:
                    call.cancel()
                assert await _until(lambda: svc.grpc_pushes == 0), svc.grpc_pushes
        finally:
            await server.stop(grace=0.5)
            await node.stop()
        assert not node.receiver.reservations
    asyncio.run(main())


def test_the_default_cap_follows_max_num_seqs():
    assert default_max_grpc_pushes(4) == MIN_GRPC_PUSHES
    assert default_max_grpc_pushes(256) == 512
    with pytest.raises(ValueError, match="max_grpc_pushes must be >= 1"):
        from decode_node.service import DecodeService
        DecodeService(None, type("R", (), {"on_release": None})(), None, None,
                      max_grpc_pushes=0)
