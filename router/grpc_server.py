"""The public gRPC API (pdserve.v1.Generation: Generate, ListModels) on its own port, with
grpc.health.v1 (SERVING while at least one prefill and one decode node are known) and,
when asked for (`--grpc-reflection`), server reflection. Shares validation, routing and
stop-string handling with the HTTP front; the API key and undecodable messages are handled
by `router/grpc_edge.py`'s interceptor.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster import tracing
from cluster.proto_convert import finish_to_proto, logprobs_to_proto, sampling_fields_from_proto
from protos import api_pb2, api_pb2_grpc, common_pb2
from router.auth import ApiKeys
from router.errors import InvalidRequest, RouterError
from router.grpc_edge import MAX_GRPC_MESSAGE_BYTES, EdgeInterceptor
from router.public_tls import PublicTls
from router.rate_limit import RateLimiter
from router.requests import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ParsedRequest,
    build_sampling,
    check_chars,
    check_prompt,
    check_request_id,
    check_token_ids,
    max_tokens_for,
    sampling_from_fields,
)
from router.schema_errors import validate
from router.schemas import MAX_LOGPROBS, Int, SamplingFields
from router.service import RouterService

log = logging.getLogger("pdserve.router")


class GenerateSampling(SamplingFields):
    """The wire's SamplingParams: the same declared ranges as the HTTP bodies (the proto's
    integer widths are wider than what the engine and the model's context can take)."""

    logprobs: Int(0, MAX_LOGPROBS) | None = None


def parse_generate(msg: api_pb2.GenerateRequest, service: RouterService) -> ParsedRequest:
    """GenerateRequest -> ParsedRequest, or InvalidRequest naming the missing/bad field.
    Blocks while tokenizing: run it off the event loop."""

    info = service.info
    if msg.model and msg.model != info.name:
        raise InvalidRequest(f"the model {msg.model[:100]!r} does not exist; this router "
                             f"serves {info.name!r}", "model")
    request_id = check_request_id(msg.request_id)
    fields = sampling_fields_from_proto(msg.sampling) if msg.HasField("sampling") else {}
    sampling = validate(GenerateSampling, fields)
    which = msg.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("the request has no prompt: set `text` or `token_ids`", "prompt")
    if which == "text":
        check_chars(len(msg.text), info, service.tokenizer, "text")
        ids = service.tokenizer.encode(msg.text) if msg.text else []
        text: str | None = msg.text
    else:
        ids = check_token_ids(list(msg.token_ids.ids), info, "token_ids")
        text = None
    check_prompt(ids, info, "prompt")
    max_tokens = max_tokens_for(len(ids), sampling.max_tokens, "max_tokens", info,
                                DEFAULT_COMPLETION_MAX_TOKENS)
    params = build_sampling(sampling_from_fields(sampling, info), max_tokens,
                            sampling.logprobs)
    return ParsedRequest("completion", request_id, info.name, [ids], [text], [params],
                         stream=True)


async def _abort(context, err: RouterError) -> None:
    """End the call with the error's code; a 429 / 503 also says when to come back, in a
    `retry-after` trailer (whole seconds), as HTTP's Retry-After header does."""
    retry = getattr(err, "retry_after_s", None)
    trailers = (("retry-after", str(retry)),) if retry else ()
    await context.abort(getattr(grpc.StatusCode, err.grpc_code), err.message, trailers)


class GenerationServicer(api_pb2_grpc.GenerationServicer):
    def __init__(self, service: RouterService):
        self.service = service

    async def Generate(self, request, context):
        try:
            req = await asyncio.to_thread(parse_generate, request, self.service)
        except RouterError as err:
            self.service.metrics.requests.labels("grpc", str(err.http_status)).inc()
            await _abort(context, err)
        run = self.service.run(req, "grpc")
        run.trace_parent = tracing.incoming(context)       # tracing on: the client's trace
        events = run.events()
        try:
            async for _, delta in events:
                resp = api_pb2.GenerateResponse(
                    request_id=req.request_id, token_ids=delta.token_ids,
                    text_delta=delta.text,
                    logprobs=logprobs_to_proto(delta.logprobs) if delta.logprobs else [])
                if delta.finish_reason is not None:
                    r = run.results[0]
                    resp.finish_reason = finish_to_proto(delta.finish_reason)
                    resp.stop_reason = str(delta.stop_reason) if delta.stop_reason is not None \
                        else ""
                    resp.usage.CopyFrom(common_pb2.Usage(
                        prompt_tokens=r.num_prompt_tokens, completion_tokens=len(r.token_ids),
                        cached_prompt_tokens=r.num_cached_tokens))
                yield resp
        except RouterError as err:
            await _abort(context, err)
        finally:
            await events.aclose()

    async def ListModels(self, request, context):
        info = self.service.info
        return api_pb2.ListModelsResponse(models=[api_pb2.ModelInfo(
            id=info.name, max_model_len=info.max_model_len, owned_by="pdserve")])


class GrpcFront:
    """The gRPC server plus a task that keeps the health status in step with the nodes."""

    def __init__(self, service: RouterService, address: str, api_keys: ApiKeys | None = None,
                 reflection_on: bool = False, public_tls: PublicTls | None = None,
                 limiter: RateLimiter | None = None):
        self.service = service
        self.server = grpc.aio.server(
            interceptors=[EdgeInterceptor(api_keys or ApiKeys(), limiter)],
            options=[("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES)])
        api_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(service), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection_on:
            # Off by default: it lists the services and their schemas to anyone who asks.
            names = (api_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                     health.SERVICE_NAME, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self.server)
        if public_tls is not None:
            self.port = self.server.add_secure_port(address, public_tls.grpc_credentials())
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (gRPC)")
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.server.start()
        self._health_task = asyncio.create_task(self._follow_health())

    async def _follow_health(self) -> None:
        last = None
        while True:
            ready = self.service.backend.ready()
            if ready != last:
                status = (health_pb2.HealthCheckResponse.SERVING if ready
                          else health_pb2.HealthCheckResponse.NOT_SERVING)
                for name in ("", "pdserve.v1.Generation"):
                    await self.health.set(name, status)
                last = ready
            await asyncio.sleep(0.2)

    async def stop(self, grace: float | None) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
