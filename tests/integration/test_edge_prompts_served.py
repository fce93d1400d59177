"""Every prompt length through a real cluster: HTTP and gRPC through the router, PD (the
KV over the raw-TCP data plane and over gRPC) and an aggregated node, bf16 and float32.

Every prompt length from 1 to 3 x block_size + 2 (block_size 16, as `pdserve up` runs),
each prompt the one before it plus a token, so from the second on its prefix is already in
the nodes' prefix caches and the prefill computes one token: the case that failed (one
length in sixteen, 1, 17, 33, 49, was refused by the decode node in bf16). Then n = 2 over
two prompts in one request, and a stop string that ends on the first token.

float32 must give the offline `LLM`'s tokens (held to HF by test_hf_exactness.py); bf16
must give the asked number of tokens, and the same tokens over HTTP and gRPC (the same
cluster, the same cached prefixes). The in-process modes and the property-based search of
the edges are tests/engine/test_edge_prompts.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import ClientSession

from engine import LLM, SamplingParams
from router.client import AsyncGenerationClient
from tests.integration.router_harness import MODEL, start_cluster
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(600)

BS = 16
MAX_TOKENS = 5
LENGTHS = list(range(1, 3 * BS + 3))
NODE_ARGS = ["--block-size", str(BS), "--num-gpu-blocks", "64", "--load-interval", "0.2",
             "--drain-timeout", "30"]
# (dtype, nodes, prefill node's KV transport)
SETUPS = [("bfloat16", "pd", "tcp"), ("bfloat16", "pd", "grpc"), ("float32", "pd", "grpc"),
          ("bfloat16", "aggregated", None), ("float32", "aggregated", None)]


@pytest.fixture(scope="module", params=SETUPS, ids=["-".join(filter(None, s)) for s in SETUPS])
def served(request, folder, tmp_path_factory):
    dtype, nodes, transport = request.param
    pd = nodes == "pd"
    cluster = start_cluster(
        folder, tmp_path_factory.mktemp(f"edge-{dtype}-{nodes}"), prefill=int(pd),
        decode=int(pd), num_aggregated=int(not pd), node_args=["--dtype", dtype, *NODE_ARGS],
        prefill_args=["--kv-transport", transport] if pd else [], core_share=True)
    yield dtype, cluster
    cluster.stop()


async def _http(http: ClientSession, url: str, body: dict) -> list[dict]:
    async with http.post(url + "/v1/completions", json=body) as resp:
        text = await resp.text()
        assert resp.status == 200, f"{resp.status}: {text}"
    return json.loads(text)["choices"]


async def _all_lengths(cluster, prompts: list[list[int]]):
    """(HTTP, gRPC) token ids and finish reasons of each prompt, one request at a time."""
    body = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                return_token_ids=True)
    via_http, via_grpc = [], []
    async with ClientSession() as http, \
            AsyncGenerationClient(cluster.grpc_address, timeout=60) as grpc_client:
        for p in prompts:
            (choice,) = await _http(http, cluster.http_url, dict(body, prompt=p))
            via_http.append((choice["token_ids"], choice["finish_reason"]))
            out = await grpc_client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0,
                                             ignore_eos=True)
            via_grpc.append((list(out.token_ids), out.finish_reason))
        two = await _http(http, cluster.http_url, dict(body, prompt=prompts[:2], n=2))
    return via_http, via_grpc, [(c["index"], c["token_ids"]) for c in two]


def test_every_prompt_length_gives_its_tokens_over_http_and_grpc(served, folder):
    dtype, cluster = served
    base = random_prompts(1, [LENGTHS[-1]], 320, seed=34)[0]
    prompts = [base[:n] for n in LENGTHS]
    via_http, via_grpc, two = asyncio.run(_all_lengths(cluster, prompts))
    failed = [n for n, (t, f) in zip(LENGTHS, via_http, strict=True)
              if len(t) != MAX_TOKENS or f != "length"]
    assert not failed, f"prompt lengths without {MAX_TOKENS} tokens over HTTP: {failed}"
    assert via_grpc == via_http, "HTTP and gRPC disagree on the same cluster"
    assert [i for i, _ in two] == [0, 1, 2, 3]
    assert two[0][1] == two[1][1] and two[2][1] == two[3][1], "greedy choices of n differ"
    if dtype == "float32":
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        ref = LLM(folder, dtype="float32", block_size=BS, num_gpu_blocks=64,
                  enable_prefix_caching=False).generate(
            [{"prompt_token_ids": p} for p in prompts], params)
        want = [list(o.outputs[0].token_ids) for o in ref]
        wrong = [n for n, got, w in zip(LENGTHS, via_http, want, strict=True) if got[0] != w]
        assert not wrong, f"prompt lengths whose tokens differ from the offline LLM: {wrong}"
        assert [t for _, t in two] == [want[0], want[0], want[1], want[1]]


def test_a_stop_string_that_ends_on_the_first_token(served, folder):
    dtype, cluster = served
    prompt = random_prompts(1, [BS + 1], 320, seed=35)[0]

    async def run(stop):
        async with ClientSession() as http:
            return await _http(http, cluster.http_url, dict(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True,
                return_token_ids=True, **({"stop": [stop]} if stop else {})))
    (plain,) = asyncio.run(run(None))
    from engine.tokenizer import load_tokenizer
    first = load_tokenizer(str(folder)).decode(plain["token_ids"][:1])
    if not first.strip() or "\ufffd" in first:
        pytest.fail(f"the first token's text {first!r} cannot serve as a stop string; "
                    f"pick another seed")
    (stopped,) = asyncio.run(run(first))
    assert stopped["finish_reason"] == "stop", stopped
    assert stopped["token_ids"] == plain["token_ids"][:1]
    assert stopped["text"] == plain["text"][:plain["text"].index(first)]
