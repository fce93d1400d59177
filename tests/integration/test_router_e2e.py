"""End to end through the router: real node processes, real gRPC, a real etcd on 127.0.0.1.

- PD output (greedy tokens and text) equals the single-node LLM for a concurrent batch of
  mixed requests (HTTP whole and SSE, chat, gRPC whole and streamed, a stop string), 1x1.
- The official `openai` client works (completions and chat, streaming and not).
- Bad input: 400 / INVALID_ARGUMENT naming the problem; the nodes stay healthy.
- A second router serves the same cluster; `pdserve generate` talks to the gRPC API.
- Block pools return to their starting counts.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from protos import api_pb2, api_pb2_grpc
from tests.integration.router_harness import (
    MODEL,
    NUM_BLOCKS,
    Req,
    assert_batch_equal,
    metric_values,
    mixed_batch,
    reference,
    run_batch,
    scrape,
    start_cluster,
    stop_request,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(folder, tmp_path_factory):
    # the nodes take turns at steps, as `pdserve up` runs them on one machine's cores
    c = start_cluster(folder, tmp_path_factory.mktemp("cluster-1x1"), prefill=1, decode=1,
                      core_share=True)
    yield c
    c.stop()


def _post(url: str, body) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_pd_1x1_equals_single_node_llm_for_a_mixed_concurrent_batch(cluster, llm):
    reqs = mixed_batch(lambda: stop_request(llm))
    assert reqs[-1].stop
    outs = asyncio.run(run_batch(cluster.http_url, cluster.grpc_address, MODEL, reqs))
    assert_batch_equal(llm, reqs, outs)
    assert outs[-1][2] == "stop"
    # once idle, every node's block pool is back to where it started (cached prefix blocks
    # stay reusable, so they count as free)
    assert wait_for(lambda: set(metric_values(scrape(cluster.http_url),
                                              "pdserve_node_free_kv_blocks").values())
                    == {NUM_BLOCKS - 1}, 10), scrape(cluster.http_url)
    text = scrape(cluster.http_url)
    assert set(metric_values(text, "pdserve_node_running_requests").values()) == {0.0}
    assert set(metric_values(text, "pdserve_router_node_inflight_requests").values()) == {0.0}
    assert 'pdserve_router_time_to_first_token_seconds_count{endpoint="completions"}' in text


def test_openai_client_completions_and_chat(cluster, llm):
    import openai

    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = "The quick brown fox"
    _, want, _ = reference(llm, Req("http", prompt, 12))
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == want
    assert out.usage.completion_tokens == 12
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want

    messages = [{"role": "user", "content": "Say something."}]
    _, want_chat, finish = reference(llm, Req("http", messages=messages, max_tokens=10))
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                          temperature=0)
    assert chat.choices[0].message.content == want_chat
    assert chat.choices[0].finish_reason == finish
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].usage.completion_tokens == 10

    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)


BAD_HTTP = [
    ("/v1/completions", "{oops", None, "not valid JSON"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, "model", "does not exist"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature",
     "temperature must be >= 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 0}, "top_k", "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 600}, "prompt",
     "maximum length is 512"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages", "non-empty"),
]


def test_bad_input_is_rejected_and_the_nodes_stay_healthy(cluster, llm):
    for path, body, param, message in BAD_HTTP:
        status, err = _post(cluster.http_url + path, body)
        assert status == 400, (path, body, err)
        assert message in err["error"]["message"] and err["error"]["param"] == param

    async def grpc_bad():
        async with grpc.aio.insecure_channel(cluster.grpc_address) as ch:
            stub = api_pb2_grpc.GenerationStub(ch)
            codes = []
            for msg in (api_pb2.GenerateRequest(model=MODEL),        # no prompt
                        api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[5, 9999]))):
                try:
                    async for _ in stub.Generate(msg):
                        pass
                except grpc.aio.AioRpcError as exc:
                    codes.append((exc.code(), exc.details()))
            return codes
    codes = asyncio.run(grpc_bad())
    assert [c for c, _ in codes] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert "no prompt" in codes[0][1] and "outside the vocabulary" in codes[1][1]

    assert all(node.alive() for node in cluster.nodes)
    req = Req("http", "Hello world, this is a test", 6)
    (got,) = asyncio.run(run_batch(cluster.http_url, cluster.grpc_address, MODEL, [req]))
    assert got == reference(llm, req)
    with urllib.request.urlopen(cluster.http_url + "/health", timeout=5) as resp:
        assert resp.reason == "OK"


def test_second_router_and_pdserve_generate(cluster, llm):
    second = cluster.add_router(0, 0, name="router-2")
    try:
        cluster.wait_ready([second], 60)
        addrs = json.loads(second.ready())
        cluster.wait_healthy(addrs["http"], 30)
        reqs = [Req("http", "The quick brown fox", 10), Req("grpc", [7, 8, 9, 10, 11], 10)]
        outs = asyncio.run(run_batch(addrs["http"], addrs["grpc"], MODEL, reqs))
        assert_batch_equal(llm, reqs, outs)

        # the CLI client, against the second router's gRPC API, whole and streamed
        for extra in ([], ["--stream"]):
            proc = subprocess.run([sys.executable, "-m", "launch.cli", "generate",
                                   "The quick brown fox", "--router", addrs["grpc"],
                                   "--max-tokens", "10", *extra], capture_output=True,
                                  text=True, timeout=60,
                                  cwd=cluster.env["PYTHONPATH"].split(":")[0], env=cluster.env)
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout == reference(llm, reqs[0])[1] + "\n"
            assert "[10 tokens, finish: length" in proc.stderr
    finally:
        second.signal(15)
        assert second.wait(30) == 0
