"""Real node processes, real gRPC, a real etcd on 127.0.0.1.

- A node registers under /pdserve/<cluster>/nodes/<role>/<id>, serves health and
  reflection, disappears at once on SIGTERM (deregistered) and within the lease TTL when
  killed outright.
- A prefill node pushes its KV to a decode node over gRPC; the decode node's greedy tokens
  equal the single-node LLM's on a tiny random model, for concurrent requests.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.discovery import ClusterView, EtcdRegistry
from engine import LLM, SamplingParams
from router.model_info import ModelInfo
from tests.integration.pd_static import generate_all
from tests.tiny_models import make_tiny_model, random_prompts

pytestmark = pytest.mark.timeout(240)

ENGINE = ["--dtype", "float32", "--block-size", "4", "--num-gpu-blocks", "128"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama-tied-gqa", tmp_path_factory.mktemp("models"))[0]


def _node_args(folder, etcd, cluster="it", ttl=2):
    return ["--model", str(folder), "--etcd", etcd.endpoint, "--cluster", cluster,
            "--lease-ttl", str(ttl), "--load-interval", "0.2", *ENGINE]


async def _health_and_services(address: str) -> tuple[int, set[str]]:
    async with grpc.aio.insecure_channel(address) as ch:
        health = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        names: set[str] = set()
        async for reply in stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5):
            names |= {s.name for s in reply.list_services_response.service}
        return health.status, names


def test_node_registers_and_leaves_on_sigterm_or_lease_expiry(etcd, start_node, folder):
    decode = start_node("decode", *_node_args(folder, etcd), "--node-id", "d1")
    prefill = start_node("prefill", *_node_args(folder, etcd), "--node-id", "p1")
    d_addr, p_addr = decode.wait_ready(), prefill.wait_ready()

    async def body():
        status, services = await _health_and_services(d_addr)
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert {"pdserve.v1.DecodeNode", "grpc.health.v1.Health"} <= services
        status, services = await _health_and_services(p_addr)
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert "pdserve.v1.PrefillNode" in services
        view = ClusterView(EtcdRegistry(etcd.endpoint, "it"))
        await view.start()
        assert await view.wait_for(lambda v: len(v.nodes()) == 2, 10)
        (rec,) = view.nodes("decode")
        assert (rec.node_id, rec.address) == ("d1", d_addr)
        assert rec.fingerprint["block_size"] == 4 and rec.incarnation
        assert await view.wait_for(lambda v: v.load("decode", "d1") is not None, 5)
        assert view.load("decode", "d1").free_blocks == 127

        t0 = time.monotonic()
        assert await asyncio.to_thread(decode.terminate) == 0       # SIGTERM: drain, exit 0
        assert await view.wait_for(lambda v: not v.nodes("decode"), 5)
        assert time.monotonic() - t0 < 2.0 + 5, "deregistered on drain, not by lease expiry"

        prefill.kill()                                              # no goodbye: lease ends it
        t0 = time.monotonic()
        assert await view.wait_for(lambda v: not v.nodes("prefill"), 2 * 2 + 3)
        assert time.monotonic() - t0 >= 0.5, "only the lease TTL could have removed it"
        await view.close()
    asyncio.run(body())


@pytest.mark.parametrize("kv_transport", ["grpc", "tcp"])
def test_pd_over_grpc_equals_single_node_llm(etcd, start_node, folder, kv_transport):
    decode = start_node("decode", *_node_args(folder, etcd))
    prefill = start_node("prefill", *_node_args(folder, etcd), "--kv-transport", kv_transport)
    decode.wait_ready()
    prefill.wait_ready()
    prompts = random_prompts(5, [3, 8, 13, 21, 40], 320, seed=11)
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1)
    ref = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=128).generate(
        [{"prompt_token_ids": p} for p in prompts], params)

    async def body():
        reg = EtcdRegistry(etcd.endpoint, "it")                     # find them as a router does
        nodes, _ = await reg.snapshot()
        await reg.close()
        p_addr = next(r.address for r in nodes.values() if r.role == "prefill")
        d_addr = next(r.address for r in nodes.values() if r.role == "decode")
        return await generate_all(p_addr, d_addr, prompts, params, prefix="it",
                                  max_model_len=ModelInfo.from_folder(folder).max_model_len)
    outs = asyncio.run(body())
    for i, (out, want) in enumerate(zip(outs, ref, strict=True)):
        assert out.token_ids == want.outputs[0].token_ids, f"prompt {i}"
        assert out.finish_reason == want.outputs[0].finish_reason
        assert len(out.logprobs) == len(out.token_ids)
        assert out.prefill is not None and out.prefill.pushed_bytes > 0
        if len(out.token_ids) > 1:      # streamed ahead of the push, and not repeated
            assert out.first_token is not None, f"prompt {i}: no early first token"
            assert out.first_token.token_id == out.token_ids[0]
            assert out.first_token.logprob.logprob == out.logprobs[0].logprob
    assert decode.terminate() == 0 and prefill.terminate() == 0
