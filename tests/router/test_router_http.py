"""The router's HTTP front over a scripted backend (the boundary to the nodes): OpenAI
bodies, SSE framing, stop strings in the router, validation and error mapping, metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from router.errors import NoNodeAvailable, Overloaded
from router.http_server import make_app
from router.metrics import RouterMetrics
from router.model_info import ModelInfo
from router.node_pool import NodePool
from router.openai_format import SSE_DONE, sse_event
from router.service import RouterService
from tests.router_fakes import TOKENS, ScriptedBackend, make_router_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_router_model_dir(tmp_path_factory.mktemp("router-model"))


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


def _serve(model_dir, backend, coro_fn):
    async def main():
        info = ModelInfo.from_folder(model_dir, name="tiny")
        service = RouterService(info, Tokenizer(model_dir), backend, RouterMetrics(NodePool()))
        server = TestServer(make_app(service), host="127.0.0.1")
        await server.start_server()
        try:
            async with ClientSession(str(server.make_url(""))) as http:
                return await coro_fn(http)
        finally:
            await server.close()
    return asyncio.run(main())


async def _post(http, path, body):
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    async with http.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read()


async def _sse(http, path, body) -> tuple[int, list]:
    status, raw = await _post(http, path, body)
    events = raw.decode().split("\n\n")
    assert events[-1] == "", "the stream must end with a blank line"
    out = []
    for ev in events[:-1]:
        assert ev.startswith("data: "), ev
        payload = ev[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return status, out


def test_sse_framing_is_exact():
    assert sse_event({"text": "é\n", "n": [1, 2]}) == (
        b'data: {"text":"\xc3\xa9\\n","n":[1,2]}\n\n')
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_completion_whole_and_streamed_agree(model_dir, tok):
    backend = ScriptedBackend(TOKENS)
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 12, "temperature": 0,
            "logprobs": 1}

    async def go(http):
        status, raw = await _post(http, "/v1/completions", body)
        sstatus, events = await _sse(http, "/v1/completions",
                                     dict(body, stream=True, stream_options={
                                         "include_usage": True}))
        return status, json.loads(raw), sstatus, events

    status, whole, sstatus, events = _serve(model_dir, backend, go)
    assert status == 200 and sstatus == 200
    assert backend.requests[0].prompt_token_ids == tok.encode("Hello world")
    choice = whole["choices"][0]
    assert choice["text"] == tok.decode(TOKENS)
    assert choice["finish_reason"] == "length"
    assert whole["object"] == "text_completion" and whole["model"] == "tiny"
    assert whole["usage"] == {"prompt_tokens": len(tok.encode("Hello world")),
                              "completion_tokens": 12,
                              "total_tokens": len(tok.encode("Hello world")) + 12,
                              "prompt_tokens_details": {"cached_tokens": 4}}
    assert choice["logprobs"]["token_logprobs"] == [-i / 10 for i in range(12)]
    assert choice["logprobs"]["top_logprobs"][0] == {tok.decode([7], False): -5.0}
    assert events[-1] == "[DONE]"
    usage_event = events[-2]
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 12
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["id"] == chunks[0]["id"] for c in chunks)


def test_stop_string_cuts_text_and_aborts_and_never_leaks_while_streaming(model_dir, tok):
    full = tok.decode(TOKENS)
    stop = full[5:8]
    backend = ScriptedBackend(TOKENS)
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "stop": [stop]}

    async def go(http):
        _, raw = await _post(http, "/v1/completions", body)
        _, events = await _sse(http, "/v1/completions", dict(body, stream=True))
        return json.loads(raw), events

    whole, events = _serve(model_dir, backend, go)
    choice = whole["choices"][0]
    assert choice["text"] == full[:full.find(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    # the engine's OutputProcessor would stop at the step whose text completed the stop
    d = IncrementalDetokenizer(tok)
    n = next(i + 1 for i in range(len(TOKENS)) if (d.add([TOKENS[i]]) or True)
             and stop in d.text)
    assert whole["usage"]["completion_tokens"] == n
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert streamed == choice["text"]
    assert backend.closed_early == 2          # both requests aborted on the "nodes"


def test_chat_whole_and_streamed(model_dir, tok):
    backend = ScriptedBackend(TOKENS[:5], finish="stop")
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    body = {"model": "tiny", "messages": msgs, "logprobs": True, "top_logprobs": 1}

    async def go(http):
        _, raw = await _post(http, "/v1/chat/completions", body)
        _, events = await _sse(http, "/v1/chat/completions", dict(body, stream=True))
        return json.loads(raw), events

    whole, events = _serve(model_dir, backend, go)
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "Hello"}])
    req = backend.requests[0]
    assert req.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert req.params.max_tokens == 64 - len(req.prompt_token_ids)    # up to the model length
    assert req.params.logprobs == 1
    msg = whole["choices"][0]
    assert whole["object"] == "chat.completion"
    assert msg["message"] == {"role": "assistant", "content": tok.decode(TOKENS[:5])}
    assert msg["finish_reason"] == "stop"
    assert [e["logprob"] for e in msg["logprobs"]["content"]] == [-i / 10 for i in range(5)]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["object"] == "chat.completion.chunk"
    body_chunks = events[1:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "")
                   for c in body_chunks) == msg["message"]["content"]
    assert body_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == "[DONE]"


def test_return_token_ids_whole_and_streamed(model_dir, tok):
    backend = ScriptedBackend(TOKENS)
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "return_token_ids": True}

    async def go(http):
        _, raw = await _post(http, "/v1/completions", body)
        _, events = await _sse(http, "/v1/completions", dict(body, stream=True))
        return json.loads(raw), events

    whole, events = _serve(model_dir, backend, go)
    assert whole["choices"][0]["token_ids"] == TOKENS
    assert whole["prompt_token_ids"] == tok.encode("Hi")
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == TOKENS


def test_batch_prompt_gives_one_choice_per_prompt(model_dir, tok):
    backend = ScriptedBackend(TOKENS[:3])

    async def go(http):
        _, raw = await _post(http, "/v1/completions",
                             {"model": "tiny", "prompt": ["a", [5, 6, 7]], "max_tokens": 3})
        _, events = await _sse(http, "/v1/completions",
                               {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 3,
                                "stream": True})
        return json.loads(raw), events

    whole, events = _serve(model_dir, backend, go)
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert all(c["text"] == tok.decode(TOKENS[:3]) for c in whole["choices"])
    assert backend.requests[1].prompt_token_ids == [5, 6, 7]
    for i in (0, 1):
        assert "".join(e["choices"][0]["text"] for e in events[:-1]
                       if e["choices"][0]["index"] == i) == tok.decode(TOKENS[:3])


def test_n_gives_n_choices_per_prompt_numbered_as_openai_does(model_dir, tok):
    """Prompt i's j-th choice is index i * n + j; prompt tokens count once per prompt; a
    seed gives each choice its own (seed + j), so sampled choices are not all the same."""
    backend = ScriptedBackend(TOKENS[:3])

    async def go(http):
        _, raw = await _post(http, "/v1/completions",
                             {"model": "tiny", "prompt": ["a", [5, 6, 7]], "max_tokens": 3,
                              "n": 3, "seed": 10, "temperature": 0.5})
        _, events = await _sse(http, "/v1/chat/completions",
                               {"model": "tiny", "max_tokens": 3, "n": 2, "stream": True,
                                "messages": [{"role": "user", "content": "hi"}]})
        return json.loads(raw), events

    whole, events = _serve(model_dir, backend, go)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3, 4, 5]
    assert all(c["text"] == tok.decode(TOKENS[:3]) for c in whole["choices"])
    prompts = [r.prompt_token_ids for r in backend.requests[:6]]
    assert prompts[3:] == [[5, 6, 7]] * 3 and prompts[0] == prompts[1] == prompts[2]
    assert [r.params.seed for r in backend.requests[:6]] == [10, 11, 12, 10, 11, 12]
    assert whole["usage"]["prompt_tokens"] == len(prompts[0]) + 3
    assert whole["usage"]["completion_tokens"] == 6 * 3
    chat = [e for e in events[:-1] if e["choices"]]
    for i in (0, 1):
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in chat
                       if e["choices"][0]["index"] == i) == tok.decode(TOKENS[:3])


BAD = [
    ("/v1/completions", "{not json", None, "not valid JSON"),
    ("/v1/completions", "[1, 2]", None, "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "model", "'gpt-4' does not exist"),
    ("/v1/completions", {"prompt": "x"}, "model", "model is required"),
    ("/v1/completions", {"model": "tiny"}, "prompt", "prompt is required"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, "prompt", "prompt is empty"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 999]}, "prompt", "outside the vocab"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, "temperature",
     "temperature must be >= 0"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, "top_p", "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens",
     "max_tokens must be in [1, 2147483647], got 0"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 17}, "n", "n must be in [1, 16]"),
    ("/v1/completions", {"model": "tiny", "prompt": ["x"] * 9, "n": 16}, "n",
     "9 prompts x n = 16 make 144 choices, more than the 128"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": "yes"}, "stream",
     "stream must be a boolean, got 'yes'"),
    ("/v1/completions", {"model": "tiny", "prompt": list(range(3, 67))}, "prompt",
     "64 tokens, but the model's maximum length is 64"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages",
     "messages must be a non-empty list"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard",
                                                            "content": "x"}]},
     "messages", "messages[0].role must be one of"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, "messages",
     "messages[0].content is required"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs"),
]


@pytest.mark.parametrize("path,body,param,message", BAD, ids=[b[3] for b in BAD])
def test_bad_input_is_400_naming_the_problem(model_dir, path, body, param, message):
    backend = ScriptedBackend(TOKENS)

    async def go(http):
        return await _post(http, path, body)

    status, raw = _serve(model_dir, backend, go)
    assert status == 400
    err = json.loads(raw)["error"]
    assert message in err["message"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert backend.requests == []                 # nothing reached a node


@pytest.mark.parametrize("error,status,kind", [
    (NoNodeAvailable("no decode node is available"), 503, "service_unavailable"),
    (Overloaded("every decode node is full"), 429, "rate_limit_error")])
@pytest.mark.parametrize("stream", [False, True])
def test_backend_errors_map_to_status_even_when_streaming(model_dir, error, status, kind,
                                                         stream):
    backend = ScriptedBackend(TOKENS, error=error)

    async def go(http):
        return await _post(http, "/v1/completions",
                           {"model": "tiny", "prompt": "x", "stream": stream})

    got, raw = _serve(model_dir, backend, go)
    assert got == status
    err = json.loads(raw)["error"]
    assert err["message"] == error.message and err["type"] == kind



def test_429_says_when_to_retry(model_dir):
    backend = ScriptedBackend(TOKENS, error=Overloaded("queue full", retry_after_s=7))

    async def go(http):
        async with http.post("/v1/completions", data=json.dumps(
                {"model": "tiny", "prompt": "x"}),
                headers={"Content-Type": "application/json"}) as r:
            return r.status, r.headers.get("Retry-After")

    assert _serve(model_dir, backend, go) == (429, "7")


def test_models_health_metrics_and_unknown_route(model_dir):
    backend = ScriptedBackend(TOKENS[:2])

    async def go(http):
        async with http.get("/v1/models") as r:
            models = await r.json()
        async with http.get("/health") as r:
            health = r.status
        await _post(http, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        await _post(http, "/v1/completions", {"model": "nope", "prompt": "x"})
        async with http.get("/metrics") as r:
            metrics = await r.text()
        async with http.get("/v1/nothing") as r:
            unknown = r.status, await r.json()
        return models, health, metrics, unknown

    models, health, metrics, unknown = _serve(model_dir, backend, go)
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert health == 200
    assert 'pdserve_router_requests_total{endpoint="completions",status="ok"} 1.0' in metrics
    assert 'pdserve_router_requests_total{endpoint="completions",status="400"} 1.0' in metrics
    assert 'pdserve_router_time_to_first_token_seconds_count{endpoint="completions"} 1.0' \
        in metrics
    assert 'pdserve_router_inter_token_latency_seconds_count{endpoint="completions"} 1.0' \
        in metrics
    assert unknown[0] == 404 and "Not Found" in unknown[1]["error"]["message"]


def test_health_names_nodes_that_serve_without_their_cpu_kernels(model_dir):
    """A node whose C++ kernels did not build says so in its discovery record; the router's
    /health stays 200 (the node serves, slower) and names it with the build's error."""
    from cluster.discovery.records import NodeRecord
    from router.discovery_feed import node_state
    from router.pd_backend import PdBackend
    from router.policies import make_policy

    record = NodeRecord("decode-0", "decode", "127.0.0.1:1", "inc",
                        kernel_error="RuntimeError: g++ not found")
    again = NodeRecord.from_json(record.to_json()[:-1] + b', "from_a_newer_node": 1}')
    assert again == record                      # unknown fields of a newer node are ignored
    pool = NodePool()
    pool.upsert(node_state(again))
    pool.upsert(node_state(NodeRecord("prefill-0", "prefill", "127.0.0.1:2", "inc")))
    backend = PdBackend(pool, make_policy("round-robin"), RouterMetrics(pool), max_model_len=64)

    async def go(http):
        async with http.get("/health") as r:
            return r.status, await r.json()

    status, body = _serve(model_dir, backend, go)
    assert status == 200 and body["status"] == "ok"
    assert body["degraded"] == {
        "decode-0": "CPU kernels not built, the torch path runs: RuntimeError: g++ not found"}
