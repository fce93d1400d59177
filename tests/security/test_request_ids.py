"""Client-chosen request ids (X-Request-Id, GenerateRequest.request_id) never reach the nodes.

Two clients may pick the same id, or guess one the router uses internally. The nodes key
requests, reservations and abort notices by the id the router sends them, so the router
must name every request by its own unique id and keep the client's only for the echo and
the logs. The backend here stands in for the nodes and keeps their rule: an abort names a
request id and reaches every live request under it.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from engine.tokenizer import Tokenizer
from router.backend import NodeRequest, StepOutput
from router.client import AsyncGenerationClient
from router.errors import RouterError
from router.grpc_server import GrpcFront
from router.http_server import make_app
from router.metrics import RouterMetrics
from router.model_info import ModelInfo
from router.node_pool import NodePool
from router.service import RouterService
from tests.router_fakes import make_router_model_dir

HOLD = 100      # a prompt starting with this token yields nothing until another was aborted
HANG = 101      # a prompt starting with this token hangs after its first token


async def _until(cond) -> None:
    # Bounded by the test's overall wait_for, so a broken router fails instead of hanging.
    while not cond():
        await asyncio.sleep(0.01)


class IdKeyedNodes:
    """Echoes each request's prompt back one token per step, after every one of `together`
    requests has arrived (so they are in flight at once). Closing a stream early aborts by
    its id, as the nodes' abort notices do: every live request with that id ends."""

    def __init__(self, together: int = 1):
        self.together = together
        self.requests: list[NodeRequest] = []
        self.live: dict[str, list[asyncio.Event]] = {}
        self.aborts = 0

    def ready(self) -> bool:
        return True

    async def generate(self, request: NodeRequest):
        rid, prompt = request.request_id, request.prompt_token_ids
        aborted = asyncio.Event()
        self.live.setdefault(rid, []).append(aborted)
        self.requests.append(request)
        finished = False
        try:
            await _until(lambda: len(self.requests) >= self.together)
            if prompt[0] == HOLD:
                await _until(lambda: self.aborts > 0)
            for i, token in enumerate(prompt):
                await asyncio.sleep(0)
                if aborted.is_set():
                    raise RouterError(f"request {rid} was aborted on the node")
                last = i == len(prompt) - 1
                finished = last      # the router may close the stream once it has the finish
                yield StepOutput([token], finish_reason="length" if last else None)
                if prompt[0] == HANG:
                    await asyncio.Event().wait()     # until the client goes away
        finally:
            self.live[rid].remove(aborted)
            if not finished:
                for flag in self.live.get(rid, []):
                    flag.set()
                self.aborts += 1


def _front(model_dir, backend, fn):
    async def main():
        info = ModelInfo.from_folder(model_dir, name="tiny")
        service = RouterService(info, Tokenizer(model_dir), backend, RouterMetrics(NodePool()))
        server = TestServer(make_app(service), host="127.0.0.1")
        await server.start_server()
        grpc_front = GrpcFront(service, "127.0.0.1:0")
        await grpc_front.start()
        try:
            async with ClientSession(str(server.make_url(""))) as http, \
                    AsyncGenerationClient(f"127.0.0.1:{grpc_front.port}") as client:
                return await fn(http, client)
        finally:
            await grpc_front.stop(None)
            await server.close()
    return asyncio.run(asyncio.wait_for(main(), 60))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_router_model_dir(tmp_path_factory.mktemp("router-model"))


def _check_unique_ids(backend: IdKeyedNodes, client_ids: set[str]) -> None:
    sent = [r.request_id for r in backend.requests]
    assert len(set(sent)) == len(sent), sent
    assert not client_ids & set(sent), "a client's id reached the nodes"


def test_same_http_request_id_twice_concurrently(model_dir):
    tok = Tokenizer(model_dir)
    backend = IdKeyedNodes(together=2)
    prompts = [[40, 41, 42], [50, 51, 52, 53]]

    async def one(http, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8}
        async with http.post("/v1/completions", data=json.dumps(body),
                             headers={"X-Request-Id": "same-id"}) as r:
            return r.status, r.headers.get("X-Request-Id"), await r.json()

    async def go(http, _client):
        return await asyncio.gather(*(one(http, p) for p in prompts))

    results = _front(model_dir, backend, go)
    for prompt, (status, header, body) in zip(prompts, results, strict=True):
        assert status == 200, body
        assert header == "same-id" and body["id"] == "cmpl-same-id"
        assert body["choices"][0]["text"] == tok.decode(prompt)
    _check_unique_ids(backend, {"same-id"})
    assert backend.aborts == 0


def test_same_grpc_request_id_twice_concurrently(model_dir):
    backend = IdKeyedNodes(together=2)
    prompts = [[40, 41, 42], [50, 51, 52, 53]]

    async def go(_http, client):
        return await asyncio.gather(*(client.generate(p, max_tokens=8, request_id="dup")
                                      for p in prompts))

    results = _front(model_dir, backend, go)
    for prompt, out in zip(prompts, results, strict=True):
        assert out.request_id == "dup"
        assert out.token_ids == prompt and out.finish_reason == "length"
    _check_unique_ids(backend, {"dup"})


def test_client_id_equal_to_an_internal_id_cannot_abort_it(model_dir):
    """A is in flight under its internal id; B names itself with that id and is cancelled
    mid-stream, which aborts B on the nodes. A must finish untouched."""
    backend = IdKeyedNodes()
    victim_prompt = [HOLD, 60, 61, 62]

    async def go(_http, client):
        victim = asyncio.create_task(client.generate(victim_prompt, max_tokens=8,
                                                     request_id="victim"))
        await _until(lambda: backend.requests)
        victim_internal = backend.requests[0].request_id
        stream = client.stream([HANG, 70, 71], max_tokens=8, request_id=victim_internal)
        first = await anext(stream)
        await stream.aclose()                       # cancels B's call: an abort on the nodes
        return victim_internal, first, await victim

    victim_internal, first, victim = _front(model_dir, backend, go)
    assert first.request_id == victim_internal      # the attacker's id is only echoed
    assert first.token_ids == [HANG]
    assert backend.aborts == 1
    assert victim.request_id == "victim"
    assert victim.token_ids == victim_prompt and victim.finish_reason == "length"
    _check_unique_ids(backend, {"victim"})
    assert [r.request_id == victim_internal for r in backend.requests] == [True, False]
