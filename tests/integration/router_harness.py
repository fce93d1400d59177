"""Helpers for end-to-end tests through the router: a local cluster on a tiny model, the
single-node reference, a mixed batch of requests over HTTP (whole and SSE) and gRPC, and
readers of the router's /metrics."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import ClientSession

from launch.local_cluster import LocalCluster, LocalClusterConfig
from router.client import AsyncGenerationClient
from tests.tiny_models import make_tiny_model, random_prompts
from tests.tiny_tokenizer import add_tiny_tokenizer

MODEL = "qwen2-gqa4"            # the tiny model whose greedy output varies most
LEASE_TTL = 2
NUM_BLOCKS = 128
NODE_ARGS = ["--dtype", "float32", "--block-size", "4", "--num-gpu-blocks", str(NUM_BLOCKS),
             "--load-interval", "0.2", "--drain-timeout", "30"]
ENGINE = dict(dtype="float32", block_size=4, num_gpu_blocks=NUM_BLOCKS)


def tiny_model_folder(root: Path, name: str = MODEL) -> Path:
    folder, _ = make_tiny_model(name, root)
    return add_tiny_tokenizer(folder)


def start_cluster(folder: Path, run_dir: Path, prefill: int, decode: int,
                  node_args: list[str] = NODE_ARGS, **config) -> LocalCluster:
    """config: more LocalClusterConfig fields (decode_args, router_args, ...)."""
    return LocalCluster(LocalClusterConfig(
        model=str(folder), num_prefill=prefill, num_decode=decode, http_port=0, grpc_port=0,
        cluster="it", policy="least-load", node_args=node_args, lease_ttl=LEASE_TTL,
        run_dir=run_dir, **config)).start(timeout=180)


@dataclass
class Req:
    """One request of the mixed batch. via: http | http-stream | grpc | grpc-stream."""
    via: str
    prompt: str | list[int] | None = None         # completions / gRPC
    max_tokens: int = 12
    messages: list[dict] | None = None            # chat (HTTP only)
    stop: list[str] = field(default_factory=list)


def mixed_batch(stop_for=None) -> list[Req]:
    """Text and token-id prompts (some sharing a prefix, some longer than several blocks),
    chat, whole and streamed, HTTP and gRPC. `stop_for(req)` may add a stop string."""
    ids = random_prompts(4, [5, 17, 30, 9], 320, seed=7)
    shared = ids[2][:16]
    reqs = [
        Req("http", "Hello world, this is a test", 12),
        Req("http-stream", "The quick brown fox", 16),
        Req("http", ids[0], 8),
        Req("http-stream", ids[1], 20),
        Req("grpc", ids[2], 10),
        Req("grpc-stream", shared + ids[3], 14),          # shares 4 blocks with the one above
        Req("http", messages=[{"role": "user", "content": "Say something."}], max_tokens=10),
        Req("http-stream", messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Prefill and decode?"}],
            max_tokens=12),
    ]
    if stop_for is not None:
        reqs.append(stop_for())
    return reqs


def reference(llm, req: Req) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) of the single-node LLM, greedy."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, stop=req.stop)
    if req.messages is not None:
        out = llm.chat(req.messages, params)[0].outputs[0]
    elif isinstance(req.prompt, str):
        out = llm.generate(req.prompt, params)[0].outputs[0]
    else:
        out = llm.generate({"prompt_token_ids": req.prompt}, params)[0].outputs[0]
    return out.token_ids, out.text, out.finish_reason


def stop_request(llm) -> Req:
    """A streamed request with a stop string that the reference output contains."""
    req = Req("http-stream", "Hello world, this is a test", 16)
    _, text, _ = reference(llm, req)
    req.stop = [text[4:6]]
    return req


def assert_batch_equal(llm, reqs: list[Req], outs) -> None:
    """Each output (token ids, text, finish reason) equals the single-node LLM's."""
    for i, (req, got) in enumerate(zip(reqs, outs, strict=True)):
        want = reference(llm, req)
        assert got[0] == want[0], f"request {i} ({req.via}): token ids differ"
        assert got[1] == want[1], f"request {i} ({req.via}): text differs"
        assert got[2] == want[2], f"request {i} ({req.via}): finish reason differs"


class Stall:
    """One request's wait for its first event (`first`) and its longest wait between
    events after that (`longest`)."""

    def __init__(self):
        self.last, self.first, self.longest = time.monotonic(), None, 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now - self.last
        else:
            self.longest = max(self.longest, now - self.last)
        self.last = now


STALL_S = 5.0            # the fault issue's bound on a stream's wait for its next event
FIRST_TOKEN_S = 20.0     # under the 30 s lease a request stuck on a failed node would wait


def check_stream_waits(reqs: list[Req], stalls: list[Stall]) -> None:
    """No stream, once started, waited over STALL_S for its next event; no first token
    waited anywhere near a reservation lease (on a loaded machine 64 queued prefills
    still take seconds). Prints both figures."""
    streams = [w for r, w in zip(reqs, stalls, strict=True) if "stream" in r.via]
    longest, first = max(w.longest for w in streams), max(w.first for w in streams)
    print(f"longest wait between a stream's events {longest:.2f} s, for a first token "
          f"{first:.2f} s")
    assert longest < STALL_S, f"a stream stalled {longest:.1f} s"
    assert first < FIRST_TOKEN_S, f"a stream waited {first:.1f} s for its first token"


async def _http(http: ClientSession, base: str, model: str, req: Req, stall: Stall):
    stream = req.via == "http-stream"
    body: dict = {"model": model, "max_tokens": req.max_tokens, "temperature": 0,
                  "stream": stream, "return_token_ids": True}
    if req.stop:
        body["stop"] = req.stop
    if req.messages is not None:
        path, body["messages"] = "/v1/chat/completions", req.messages
    else:
        path, body["prompt"] = "/v1/completions", req.prompt
    async with http.post(base + path, json=body) as resp:
        if resp.status != 200:
            raise AssertionError(f"{resp.status}: {await resp.text()}")
        if not stream:
            choice = (await resp.json())["choices"][0]
            stall.tick()
            text = choice["message"]["content"] if req.messages is not None else choice["text"]
            return choice["token_ids"], text, choice["finish_reason"]
        tokens, text, finish = [], "", None
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            stall.tick()
            assert "error" not in event, event
            choice = event["choices"][0]
            tokens += choice.get("token_ids", [])
            text += (choice["delta"].get("content") or "") if req.messages is not None \
                else choice["text"]
            finish = choice["finish_reason"] or finish
        return tokens, text, finish


async def _grpc(address: str, req: Req, stall: Stall):
    async with AsyncGenerationClient(address, timeout=120) as client:
        if req.via == "grpc":
            out = await client.generate(req.prompt, max_tokens=req.max_tokens, temperature=0.0,
                                        stop=req.stop or None)
            stall.tick()
            return out.token_ids, out.text, out.finish_reason
        tokens, text, finish = [], "", None
        async for chunk in client.stream(req.prompt, max_tokens=req.max_tokens,
                                         temperature=0.0, stop=req.stop or None):
            stall.tick()
            tokens += chunk.token_ids
            text += chunk.text
            finish = chunk.finish_reason or finish
        return tokens, text, finish


async def run_batch(http_url: str, grpc_address: str, model: str, reqs: list[Req],
                    stalls: list[Stall] | None = None):
    """Outputs of `reqs` sent at once; `stalls` (if given) gets each request's Stall."""
    watch = [Stall() for _ in reqs]
    if stalls is not None:
        stalls.extend(watch)
    async with ClientSession() as http:
        return await asyncio.gather(*[
            _grpc(grpc_address, r, w) if r.via.startswith("grpc")
            else _http(http, http_url, model, r, w) for r, w in zip(reqs, watch, strict=True)])


# ---- /metrics ----------------------------------------------------------------------------
def metric_values(text: str, name: str) -> dict[str, float]:
    """{node: value} of a per-node gauge in Prometheus text."""
    out = {}
    for m in re.finditer(rf'^{name}{{node="([^"]+)",role="[^"]+"}} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def scrape(http_url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{http_url}/metrics", timeout=5) as resp:
        return resp.read().decode()


def router_inflight(http_url: str) -> dict[str, float]:
    """{node: requests the router has on it now}, from its /metrics."""
    return metric_values(scrape(http_url), "pdserve_router_node_inflight_requests")


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def counter_total(text: str, name: str) -> float:
    """The sum over labels of the counter `name` (without `_total`) in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == name
               for s in fam.samples if s.name == f"{name}_total")


async def stream_killing_the_busy_decode(cluster, model: str, prompt: list[int],
                                         max_tokens: int, kill) -> tuple[list[int], str,
                                                                         str | None, list[str]]:
    """Stream a greedy completion over HTTP; once 3 tokens arrived, `kill(node)` the one
    decode node serving it (awaited in a thread). (tokens, text, finish reason, the names
    of the nodes killed: one, or none if the request finished first).

    The decode nodes are stopped (SIGSTOP) the moment the third token arrives, and resumed
    just before the kill: finding the busy one (a scrape of the router) takes long on a
    loaded machine, and a node left running meanwhile could finish the whole request
    first (it did: 480 tokens in 0.5 s, then nothing left to replay)."""
    tokens, text, finish, killed = [], "", None, []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True}
    async with ClientSession() as http, \
            http.post(cluster.http_url + "/v1/completions", json=body) as resp:
        assert resp.reason == "OK"
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            tokens += choice["token_ids"]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            if len(tokens) >= 3 and not killed:
                decodes = [c for c in cluster.nodes if c.name.startswith("decode")]
                for node in decodes:
                    node.signal(signal.SIGSTOP)
                try:
                    busy = [n for n, v in (await asyncio.to_thread(
                        router_inflight, cluster.http_url)).items()
                        if n.startswith("decode") and v > 0]
                    assert len(busy) == 1, busy
                finally:
                    for node in decodes:
                        node.signal(signal.SIGCONT)
                await asyncio.to_thread(kill, next(c for c in decodes if c.name == busy[0]))
                killed.append(busy[0])
    return tokens, text, finish, killed
