"""The router's gRPC front (Generate, ListModels, health, reflection) and the Python client
(sync and asyncio) over real gRPC, with a scripted backend behind the router."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.tokenizer import Tokenizer
from protos import api_pb2, api_pb2_grpc
from router.client import AsyncGenerationClient, GenerationClient
from router.errors import NoNodeAvailable
from router.grpc_server import GrpcFront
from router.metrics import RouterMetrics
from router.model_info import ModelInfo
from router.node_pool import NodePool
from router.service import RouterService
from tests.router_fakes import TOKENS, ScriptedBackend, make_router_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_router_model_dir(tmp_path_factory.mktemp("router-model"))


def _with_front(model_dir, backend, fn, **front_options):
    async def main():
        info = ModelInfo.from_folder(model_dir, name="tiny")
        service = RouterService(info, Tokenizer(model_dir), backend, RouterMetrics(NodePool()))
        front = GrpcFront(service, "127.0.0.1:0", **front_options)
        await front.start()
        await asyncio.sleep(0.3)               # the health follower's first pass
        try:
            return await fn(f"127.0.0.1:{front.port}")
        finally:
            await front.stop(None)
    return asyncio.run(asyncio.wait_for(main(), 60))


def test_generate_streams_and_sync_client_agrees(model_dir):
    tok = Tokenizer(model_dir)
    backend = ScriptedBackend(TOKENS[:6], finish="stop")

    async def go(addr):
        async with AsyncGenerationClient(addr) as c:
            chunks = [ch async for ch in c.stream("Hello", max_tokens=6, temperature=0,
                                                   logprobs=1)]
            models = await c.list_models()

        def sync():
            with GenerationClient(addr) as c:
                return c.generate([5, 6, 7], max_tokens=6, request_id="abc")
        whole = await asyncio.to_thread(sync)
        return chunks, models, whole

    chunks, models, whole = _with_front(model_dir, backend, go)
    assert models == ["tiny"]
    assert [t for ch in chunks for t in ch.token_ids] == TOKENS[:6]
    assert "".join(ch.text for ch in chunks) == tok.decode(TOKENS[:6])
    assert chunks[-1].finish_reason == "stop" and chunks[0].finish_reason is None
    assert chunks[-1].usage == {"prompt_tokens": len(tok.encode("Hello")),
                                "completion_tokens": 6, "cached_prompt_tokens": 4}
    assert [round(e.logprob, 4) for ch in chunks for e in ch.logprobs] == [
        round(-i / 10, 4) for i in range(6)]
    assert backend.requests[0].params.temperature == 0.0
    assert backend.requests[1].prompt_token_ids == [5, 6, 7]
    assert backend.requests[1].params.temperature == 1.0      # unset: the engine default
    assert whole.request_id == "abc" and whole.text == tok.decode(TOKENS[:6])


@pytest.mark.parametrize("request_msg,message", [
    (api_pb2.GenerateRequest(), "no prompt"),
    (api_pb2.GenerateRequest(text=""), "prompt is empty"),
    (api_pb2.GenerateRequest(model="other", text="x"), "'other' does not exist"),
    (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[1, 4000])), "outside the vocab"),
])
def test_bad_requests_are_invalid_argument(model_dir, request_msg, message):
    backend = ScriptedBackend(TOKENS)

    async def go(addr):
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = api_pb2_grpc.GenerationStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(request_msg):
                    pass
            return info.value

    err = _with_front(model_dir, backend, go)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.details()
    assert backend.requests == []


def test_bad_sampling_param_names_the_field(model_dir):
    async def go(addr):
        async with AsyncGenerationClient(addr) as c:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.generate("x", top_p=1.5)
            return info.value

    err = _with_front(model_dir, ScriptedBackend(TOKENS), go)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "top_p must be in (0, 1], got 1.5"


def test_no_node_is_unavailable_and_health_follows_readiness(model_dir):
    async def go(addr):
        async with grpc.aio.insecure_channel(addr) as ch:
            hstub = health_pb2_grpc.HealthStub(ch)
            status = (await hstub.Check(health_pb2.HealthCheckRequest(service=""))).status
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            names = []
            async for resp in refl.ServerReflectionInfo(iter([
                    reflection_pb2.ServerReflectionRequest(list_services="")])):
                names = [s.name for s in resp.list_services_response.service]
        async with AsyncGenerationClient(addr) as c:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.generate("x")
        return status, names, info.value

    status, names, err = _with_front(
        model_dir, ScriptedBackend(TOKENS, error=NoNodeAvailable("no decode node is available")),
        go, reflection_on=True)
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert "pdserve.v1.Generation" in names and "grpc.health.v1.Health" in names
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == "no decode node is available"
