"""A small Python client for the router's gRPC API (pdserve.v1.Generation), sync and asyncio.

    from router.client import GenerationClient
    with GenerationClient("127.0.0.1:50051") as c:
        print(c.generate("Hello", max_tokens=16, temperature=0).text)
        for chunk in c.stream("Hello", max_tokens=16):
            print(chunk.text, end="", flush=True)

    async with AsyncGenerationClient("127.0.0.1:50051") as c:
        out = await c.generate([1, 2, 3], max_tokens=8)
        async for chunk in c.stream("Hello"):
            ...

A router started with `--api-key` needs the key: `GenerationClient(addr, api_key="...")`,
or the environment variable PDSERVE_API_KEY (its first comma-separated key) when api_key
is not given; it is sent as the metadata `authorization: Bearer <key>`.

Sampling keywords are the engine's SamplingParams names (max_tokens, temperature, top_p,
top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty, stop, stop_token_ids,
ignore_eos, seed, logprobs, skip_special_tokens); unset ones take the server's defaults.
Errors are `grpc.RpcError`s with the server's code (INVALID_ARGUMENT, UNAVAILABLE, ...).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from cluster.proto_convert import logprobs_from_proto
from engine.logprobs import TokenLogprob
from protos import api_pb2, api_pb2_grpc, common_pb2

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort"}
_SCALARS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "ignore_eos", "seed", "logprobs",
            "skip_special_tokens")


@dataclass
class Chunk:
    """One streamed response: the new tokens and their text."""
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_reason: str | None
    usage: dict | None


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    usage: dict | None = None

    def add(self, chunk: Chunk) -> None:
        self.request_id = chunk.request_id
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason
            self.usage = chunk.usage


def build_request(prompt: str | list[int], model: str = "", request_id: str = "",
                  **sampling) -> api_pb2.GenerateRequest:
    unknown = sorted(set(sampling) - set(_SCALARS) - {"stop", "stop_token_ids"})
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: "
                         f"{', '.join(_SCALARS + ('stop', 'stop_token_ids'))}")
    sp = common_pb2.SamplingParams()
    for name, value in sampling.items():
        if value is None:
            continue
        if name == "stop":
            sp.stop.extend([value] if isinstance(value, str) else list(value))
        elif name == "stop_token_ids":
            sp.stop_token_ids.extend(value)
        else:
            setattr(sp, name, value)
    req = api_pb2.GenerateRequest(model=model, request_id=request_id, sampling=sp)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _credentials(tls_ca: str | None):
    if tls_ca is None:
        return None
    with open(tls_ca, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata carrying `api_key` (or PDSERVE_API_KEY's first key when None)."""
    if api_key is None:
        api_key = next((k.strip() for k in os.environ.get("PDSERVE_API_KEY", "").split(",")
                        if k.strip()), None)
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def to_chunk(resp: api_pb2.GenerateResponse) -> Chunk:
    finish = _FINISH.get(resp.finish_reason)
    usage = None
    if resp.HasField("usage"):
        usage = {"prompt_tokens": resp.usage.prompt_tokens,
                 "completion_tokens": resp.usage.completion_tokens,
                 "cached_prompt_tokens": resp.usage.cached_prompt_tokens}
    return Chunk(resp.request_id, list(resp.token_ids), resp.text_delta,
                 logprobs_from_proto(resp.logprobs),
                 finish, (resp.stop_reason or None) if finish else None, usage)


class GenerationClient:
    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None,
                 api_key: str | None = None, tls_ca: str | None = None):
        """tls_ca: a PEM file of the CA that signed the router's certificate: TLS (a
        router with --public-tls-cert); None: plaintext."""
        creds = _credentials(tls_ca)
        self.channel = (grpc.secure_channel(address, creds) if creds is not None
                        else grpc.insecure_channel(address))
        self.metadata = auth_metadata(api_key)
        self.stub = api_pb2_grpc.GenerationStub(self.channel)
        self.timeout = timeout

    def stream(self, prompt: str | list[int], model: str = "", request_id: str = "",
               **sampling) -> Iterator[Chunk]:
        call = self.stub.Generate(build_request(prompt, model, request_id, **sampling),
                                  timeout=self.timeout, metadata=self.metadata)
        try:
            for resp in call:
                yield to_chunk(resp)
        finally:
            call.cancel()

    def generate(self, prompt: str | list[int], model: str = "", request_id: str = "",
                 **sampling) -> Completion:
        out = Completion()
        for chunk in self.stream(prompt, model, request_id, **sampling):
            out.add(chunk)
        return out

    def list_models(self) -> list[str]:
        return [m.id for m in self.stub.ListModels(api_pb2.ListModelsRequest(),
                                                   timeout=self.timeout,
                                                   metadata=self.metadata).models]

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGenerationClient:
    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None,
                 api_key: str | None = None, tls_ca: str | None = None):
        creds = _credentials(tls_ca)
        self.channel = (grpc.aio.secure_channel(address, creds) if creds is not None
                        else grpc.aio.insecure_channel(address))
        self.metadata = auth_metadata(api_key)
        self.stub = api_pb2_grpc.GenerationStub(self.channel)
        self.timeout = timeout

    async def stream(self, prompt: str | list[int], model: str = "", request_id: str = "",
                     **sampling) -> AsyncIterator[Chunk]:
        call = self.stub.Generate(build_request(prompt, model, request_id, **sampling),
                                  timeout=self.timeout, metadata=self.metadata)
        try:
            async for resp in call:
                yield to_chunk(resp)
        finally:
            call.cancel()

    async def generate(self, prompt: str | list[int], model: str = "", request_id: str = "",
                       **sampling) -> Completion:
        out = Completion()
        async for chunk in self.stream(prompt, model, request_id, **sampling):
            out.add(chunk)
        return out

    async def list_models(self) -> list[str]:
        resp = await self.stub.ListModels(api_pb2.ListModelsRequest(), timeout=self.timeout,
                                          metadata=self.metadata)
        return [m.id for m in resp.models]

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
