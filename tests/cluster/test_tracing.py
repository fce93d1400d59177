"""OpenTelemetry tracing (cluster/tracing.py), with the SDK's in-memory exporter: a request
through the router is one trace (its span, the phases of its attempt, its stream) whose
context reaches the nodes in the gRPC metadata of the Decode and Prefill calls (scripted
gRPC nodes at the boundary, tests/router/pd_fakes.py); a node's RequestTimer continues the
caller's trace with the node's phases; off, nothing is recorded or sent; the flags."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster import tracing
from cluster.request_timing import RequestTimer
from engine.tokenizer import Tokenizer
from launch.cli import build_parser
from launch.cli_common import CliError, configure_tracing
from protos import node_pb2_grpc
from router.metrics import RouterMetrics
from router.model_info import ModelInfo
from router.node_pool import NodePool, NodeState
from router.pd_backend import PdBackend
from router.policies import make_policy
from router.requests import parse_completion
from router.service import RouterService
from tests.router.pd_fakes import FakeDecode, FakePrefill, Shared, _serve
from tests.router_fakes import make_router_model_dir


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.install(None)


class RecordingDecode(FakeDecode):
    async def Decode(self, request, context):
        self.shared.metadata.append(("decode", dict(context.invocation_metadata())))
        async for event in super().Decode(request, context):
            yield event


class RecordingPrefill(FakePrefill):
    async def Prefill(self, request, context):
        self.shared.metadata.append(("prefill", dict(context.invocation_metadata())))
        await super().Prefill(request, context)


def _pd_request(tmp_path) -> list[tuple[str, dict]]:
    """One completion through RouterService over a PD pair of recording fake nodes; the
    metadata each node call carried."""
    model_dir = make_router_model_dir(tmp_path)
    info, tokenizer = ModelInfo.from_folder(model_dir, name="tiny"), Tokenizer(model_dir)

    async def main():
        shared = Shared()
        shared.metadata = []
        pool, servers = NodePool(), []
        for role, servicer, add in [
                ("prefill", RecordingPrefill(shared),
                 node_pb2_grpc.add_PrefillNodeServicer_to_server),
                ("decode", RecordingDecode(shared),
                 node_pb2_grpc.add_DecodeNodeServicer_to_server)]:
            server, address = await _serve(servicer, add)
            servers.append(server)
            pool.upsert(NodeState(f"{role}-0", role, address, incarnation="x"))
        metrics = RouterMetrics(pool)
        backend = PdBackend(pool, make_policy("round-robin"), metrics, max_model_len=512)
        service = RouterService(info, tokenizer, backend, metrics)
        req = parse_completion({"model": "tiny", "prompt": "Hello", "max_tokens": 4}, info,
                               tokenizer)
        deltas = [d async for _, d in service.run(req, "completions").events()]
        for s in servers:
            await s.stop(None)
        await backend.close()
        assert deltas
        return shared.metadata

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_a_pd_request_is_one_trace_whose_context_reaches_both_nodes(spans, tmp_path):
    metadata = _pd_request(tmp_path)
    finished = spans.get_finished_spans()
    (root,) = [s for s in finished if s.name == "pdserve.request"]
    assert root.parent is None and root.attributes["pdserve.status"] == "ok"
    children = {s.name: s for s in finished if s is not root}
    assert set(children) == {"router.route", "router.reserve", "router.prefill",
                             "router.first_token", "router.stream"}
    for child in children.values():
        assert child.context.trace_id == root.context.trace_id
        assert child.parent.span_id == root.context.span_id
    ctx = root.context
    want = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    assert [(role, md.get("traceparent")) for role, md in metadata] == [
        ("decode", want), ("prefill", want)]


class _Call:
    """What a node's service reads of its gRPC call: the invocation metadata."""

    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


class _Seq:
    def __init__(self, first_scheduled: float):
        self.first_scheduled = first_scheduled


def test_a_node_continues_the_callers_trace_with_its_phases(spans):
    caller = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    parent = tracing.incoming(_Call((("traceparent", caller), ("other", "x"))))
    prefill = RequestTimer(None, "prefill_node.Prefill", parent, "r1")
    prefill.seq = _Seq(prefill.arrival)
    prefill.prefilled(push_started=prefill.arrival)
    aggregated = RequestTimer(None, "aggregated_node.Decode", parent, "r2")
    aggregated.seq = _Seq(aggregated.arrival)
    aggregated.tokens(1, self_prefilled=True)
    aggregated.tokens(2, self_prefilled=True)
    aggregated.finished("length")
    decode = RequestTimer(None, "decode_node.Decode", None, "r3")     # no caller context
    decode.tokens(1, self_prefilled=False)
    decode.finished("stop")

    finished = spans.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in finished:
        by_name.setdefault(s.name, []).append(s)
    calls = {n: by_name[n][0] for n in ("prefill_node.Prefill", "aggregated_node.Decode",
                                        "decode_node.Decode")}
    for name in ("prefill_node.Prefill", "aggregated_node.Decode"):
        span = calls[name]
        assert span.context.trace_id == int("ab" * 16, 16)
        assert span.parent.span_id == int("cd" * 8, 16) and span.parent.is_remote
    assert calls["decode_node.Decode"].parent is None
    assert calls["aggregated_node.Decode"].attributes["pdserve.output_tokens"] == 3
    assert calls["decode_node.Decode"].attributes["pdserve.finish_reason"] == "stop"

    def kids(call):
        return sorted(s.name for s in finished
                      if s.parent is not None and s.parent.span_id == call.context.span_id)

    assert kids(calls["prefill_node.Prefill"]) == ["kv_push", "prefill", "queue"]
    assert kids(calls["aggregated_node.Decode"]) == ["decode", "prefill", "queue"]
    assert kids(calls["decode_node.Decode"]) == ["admission", "decode"]


def test_off_nothing_is_recorded_or_sent(spans, tmp_path):
    tracing.install(None)
    metadata = _pd_request(tmp_path)
    timer = RequestTimer(None, "decode_node.Decode", tracing.incoming(_Call(())), "r")
    timer.tokens(1, self_prefilled=False)
    timer.finished("length")
    assert spans.get_finished_spans() == ()
    assert all("traceparent" not in md for _, md in metadata)
    assert not tracing.enabled() and tracing.outgoing() is None


def test_flags_configure_the_exporter_or_name_what_is_wrong(monkeypatch):
    parse = lambda *argv: build_parser().parse_args(list(argv))
    for command in ("router", "prefill", "decode", "aggregated"):
        assert parse(command).otel_exporter == "none"
    monkeypatch.setenv("PDSERVE_OTEL_EXPORTER", "console")
    args = parse("decode")
    assert args.otel_exporter == "console"
    try:
        configure_tracing(args, "pdserve-decode")
        assert tracing.enabled()
    finally:
        tracing.install(None)
    configure_tracing(parse("router", "--otel-exporter", "none"), "pdserve-router")
    assert not tracing.enabled()
    with pytest.raises(ValueError, match="--otel-exporter must be one of"):
        tracing.configure("x", "jaeger")
    with pytest.raises(SystemExit):
        parse("prefill", "--otel-exporter", "jaeger")
    monkeypatch.setenv("PDSERVE_OTEL_EXPORTER", "jaeger")      # env values skip `choices`
    with pytest.raises(CliError, match="--otel-exporter must be one of"):
        configure_tracing(parse("router"), "pdserve-router")


CLIENT = "00-" + "12" * 16 + "-" + "34" * 8 + "-01"


def _root_parent(spans) -> tuple[int, int]:
    (root,) = [s for s in spans.get_finished_spans() if s.name == "pdserve.request"]
    return root.context.trace_id, root.parent.span_id


def test_a_client_traceparent_over_http_becomes_the_request_spans_parent(spans, tmp_path):
    from aiohttp import ClientSession
    from aiohttp.test_utils import TestServer

    from router.http_server import make_app
    from tests.router_fakes import TOKENS, ScriptedBackend

    model_dir = make_router_model_dir(tmp_path)

    async def main():
        info = ModelInfo.from_folder(model_dir, name="tiny")
        service = RouterService(info, Tokenizer(model_dir), ScriptedBackend(TOKENS[:3]),
                                RouterMetrics(NodePool()))
        server = TestServer(make_app(service), host="127.0.0.1")
        await server.start_server()
        try:
            async with ClientSession(str(server.make_url(""))) as http:
                async with http.post("/v1/completions", json={
                        "model": "tiny", "prompt": "Hello", "max_tokens": 3},
                        headers={"traceparent": CLIENT}) as r:
                    return r.status
        finally:
            await server.close()

    assert asyncio.run(main()) == 200
    assert _root_parent(spans) == (int("12" * 16, 16), int("34" * 8, 16))


def test_a_client_traceparent_over_grpc_becomes_the_request_spans_parent(spans, tmp_path):
    import grpc as grpc_mod

    from protos import api_pb2, api_pb2_grpc, common_pb2
    from router.grpc_server import GrpcFront
    from tests.router_fakes import TOKENS, ScriptedBackend

    model_dir = make_router_model_dir(tmp_path)

    async def main():
        info = ModelInfo.from_folder(model_dir, name="tiny")
        service = RouterService(info, Tokenizer(model_dir), ScriptedBackend(TOKENS[:3]),
                                RouterMetrics(NodePool()))
        front = GrpcFront(service, "127.0.0.1:0")
        await front.start()
        try:
            async with grpc_mod.aio.insecure_channel(f"127.0.0.1:{front.port}") as ch:
                stub = api_pb2_grpc.GenerationStub(ch)
                call = stub.Generate(api_pb2.GenerateRequest(
                    text="Hello", sampling=common_pb2.SamplingParams(max_tokens=3)),
                    metadata=(("traceparent", CLIENT),))
                return [event async for event in call]
        finally:
            await front.stop(None)

    assert asyncio.run(asyncio.wait_for(main(), 30))
    assert _root_parent(spans) == (int("12" * 16, 16), int("34" * 8, 16))
