"""Real node processes with MTP: `pdserve decode --speculative-method mtp --enable-graph`
fed by `pdserve prefill --speculative-method mtp` (which pushes the draft's KV and the last
hidden state with the prompt's KV) gives the single-node plain LLM's greedy tokens, over
real gRPC with a real etcd, on a tiny random model with a random MTP draft."""

from __future__ import annotations

import asyncio

import pytest

from cluster.discovery import EtcdRegistry
from engine import LLM, SamplingParams
from router.model_info import ModelInfo
from tests.integration.pd_static import generate_all
from tests.tiny_models import make_tiny_model, random_prompts
from tests.tiny_mtp import with_mtp

pytestmark = pytest.mark.timeout(240)

ENGINE = ["--dtype", "float32", "--block-size", "4", "--num-gpu-blocks", "128"]
MTP = ["--speculative-method", "mtp", "--num-speculative-tokens", "2"]


@pytest.fixture(scope="module", params=[(), (0, 1)], ids=["final-hidden", "aux-layers"])
def folder(tmp_path_factory, request):
    """A head on the final hidden state, and one that also reads mid-layer features (the
    decode node's graph buffers and the push's MTP payload carry its draft input)."""
    root = tmp_path_factory.mktemp("models")
    base, _ = make_tiny_model("llama-tied-gqa", root)
    return with_mtp(base, root / "llama-mtp", aux_layers=request.param)


def _node_args(folder, etcd):
    return ["--model", str(folder), "--etcd", etcd.endpoint, "--cluster", "mtp",
            "--lease-ttl", "2", "--load-interval", "0.2", *ENGINE, *MTP]


def test_pd_with_mtp_and_graphs_on_the_decode_node_equals_plain_llm(etcd, start_node,
                                                                     folder):
    decode = start_node("decode", *_node_args(folder, etcd), "--enable-graph")
    prefill = start_node("prefill", *_node_args(folder, etcd), "--kv-transport", "tcp")
    decode.wait_ready()
    prefill.wait_ready()
    prompts = random_prompts(4, [3, 9, 17, 30], 320, seed=13)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=128).generate(
        [{"prompt_token_ids": p} for p in prompts], params)

    async def body():
        reg = EtcdRegistry(etcd.endpoint, "mtp")
        nodes, _ = await reg.snapshot()
        await reg.close()
        p_addr = next(r.address for r in nodes.values() if r.role == "prefill")
        d_rec = next(r for r in nodes.values() if r.role == "decode")
        assert d_rec.fingerprint["mtp_enabled"] is True
        return await generate_all(p_addr, d_rec.address, prompts, params, prefix="mtp",
                                  max_model_len=ModelInfo.from_folder(folder).max_model_len)
    outs = asyncio.run(body())
    for i, (out, want) in enumerate(zip(outs, ref, strict=True)):
        assert out.token_ids == want.outputs[0].token_ids, f"prompt {i}"
        assert out.prefill is not None and out.prefill.pushed_bytes > 0
    assert decode.terminate() == 0 and prefill.terminate() == 0
