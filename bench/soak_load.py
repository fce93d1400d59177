"""The soak's load: a fixed pool of greedy requests (token-id, text and chat prompts of
varied lengths, some sharing long prefixes; whole and streamed, over HTTP and gRPC) with
each one's undisturbed single-node output, and workers that send them through the router
until a deadline and record what came back.

A request fails when it raises or gets a non-200 status; it mismatches when its tokens,
text or finish reason differ from the reference (greedy float32: the cluster must give
exactly what one in-process engine gives)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from aiohttp import ClientSession, ClientTimeout

from router.client import AsyncGenerationClient

VIAS = ("http", "http-stream", "grpc", "grpc-stream")
WORDS = ("the quick brown fox jumps over a lazy dog while prefill and decode nodes share "
         "their cache across one small cluster that serves many streams at once").split()


@dataclass
class Req:
    """via: http | http-stream | grpc | grpc-stream."""
    via: str
    prompt: str | list[int] | None = None
    max_tokens: int = 12
    messages: list[dict] | None = None     # chat (HTTP only)


@dataclass
class Result:
    index: int                  # into the pool
    via: str
    start: float                # seconds since the load began
    seconds: float
    stall: float                # the longest wait for the next event (first token included)
    error: str | None = None
    mismatch: str | None = None


def make_pool(seed: int, size: int, vocab: int) -> list[Req]:
    """`size` requests; a third of the token prompts share one of 3 long prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randrange(24, 49))]
                for _ in range(3)]
    pool = []
    for i in range(size):
        via = VIAS[i % len(VIAS)]
        max_tokens = rng.choice((4, 8, 16, 24, 32, 48))
        kind = rng.random()
        if kind < 0.15 and via.startswith("http"):
            words = rng.sample(WORDS, rng.randrange(2, 8))
            pool.append(Req(via, max_tokens=max_tokens, messages=[
                {"role": "user", "content": " ".join(words).capitalize() + "?"}]))
        elif kind < 0.35:
            pool.append(Req(via, " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 40))),
                            max_tokens))
        else:
            body = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 90))]
            if rng.random() < 0.4:
                body = rng.choice(prefixes) + body
            pool.append(Req(via, body, max_tokens))
    return pool


def references(llm, pool: list[Req]) -> list[tuple]:
    """(token ids, text, finish reason) of each request, alone on one in-process engine."""
    from engine import SamplingParams

    out = []
    for req in pool:
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0)
        if req.messages is not None:
            got = llm.chat(req.messages, params)[0].outputs[0]
        elif isinstance(req.prompt, str):
            got = llm.generate(req.prompt, params)[0].outputs[0]
        else:
            got = llm.generate({"prompt_token_ids": req.prompt}, params)[0].outputs[0]
        out.append((list(got.token_ids), got.text, got.finish_reason))
    return out


class _Stall:
    def __init__(self):
        self.last, self.longest = time.monotonic(), 0.0

    def tick(self) -> None:
        now = time.monotonic()
        self.longest, self.last = max(self.longest, now - self.last), now


async def _http(http: ClientSession, base: str, model: str, req: Req, stall: _Stall):
    stream = req.via == "http-stream"
    body: dict = {"model": model, "max_tokens": req.max_tokens, "temperature": 0,
                  "stream": stream, "return_token_ids": True}
    if req.messages is not None:
        path, body["messages"] = "/v1/chat/completions", req.messages
    else:
        path, body["prompt"] = "/v1/completions", req.prompt
    chat = req.messages is not None
    async with http.post(base + path, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        if not stream:
            choice = (await resp.json())["choices"][0]
            stall.tick()
            return (choice["token_ids"], choice["message"]["content"] if chat
                    else choice["text"], choice["finish_reason"])
        tokens, text, finish = [], "", None
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            stall.tick()
            if "error" in event:
                raise RuntimeError(f"SSE error event: {event['error']}")
            choice = event["choices"][0]
            tokens += choice.get("token_ids", [])
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            finish = choice["finish_reason"] or finish
        return tokens, text, finish


async def _grpc(client: AsyncGenerationClient, req: Req, stall: _Stall):
    if req.via == "grpc":
        out = await client.generate(req.prompt, max_tokens=req.max_tokens, temperature=0.0)
        stall.tick()
        return list(out.token_ids), out.text, out.finish_reason
    tokens, text, finish = [], "", None
    async for chunk in client.stream(req.prompt, max_tokens=req.max_tokens, temperature=0.0):
        stall.tick()
        tokens += chunk.token_ids
        text += chunk.text
        finish = chunk.finish_reason or finish
    return tokens, text, finish


@dataclass
class Load:
    """`concurrency` workers, each sending random pool requests back to back (with a short
    random pause) until `stop` is set."""
    http_url: str
    grpc_address: str
    model: str
    pool: list[Req]
    refs: list[tuple]
    concurrency: int = 6
    seed: int = 0
    pause_s: float = 0.2
    request_timeout_s: float = 120.0
    results: list[Result] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> list[Result]:
        t0 = time.monotonic()
        timeout = ClientTimeout(total=self.request_timeout_s)
        async with ClientSession(timeout=timeout) as http, AsyncGenerationClient(
                self.grpc_address, timeout=self.request_timeout_s) as grpc_client:
            await asyncio.gather(*[self._worker(w, t0, stop, http, grpc_client)
                                   for w in range(self.concurrency)])
        return self.results

    async def _worker(self, w: int, t0: float, stop: asyncio.Event, http, grpc_client):
        rng = random.Random(self.seed * 1000 + w)
        while not stop.is_set():
            index = rng.randrange(len(self.pool))
            req = self.pool[index]
            stall, began = _Stall(), time.monotonic()
            result = Result(index, req.via, began - t0, 0.0, 0.0)
            try:
                got = await (_grpc(grpc_client, req, stall) if req.via.startswith("grpc")
                             else _http(http, self.http_url, self.model, req, stall))
                if tuple(got) != self.refs[index]:
                    result.mismatch = f"got {got!r}, want {self.refs[index]!r}"[:600]
            except Exception as exc:  # noqa: BLE001 - every failure is counted, none ends the soak
                result.error = f"{type(exc).__name__}: {exc}"[:600]
            result.seconds, result.stall = time.monotonic() - began, stall.longest
            self.results.append(result)
            await asyncio.sleep(rng.uniform(0, 2 * self.pause_s))
