"""Malformed input at the gRPC edge: bytes that are no GenerateRequest are INVALID_ARGUMENT
(not INTERNAL/UNKNOWN), an oversize message RESOURCE_EXHAUSTED, and well-formed messages
with bad values INVALID_ARGUMENT naming the field; nothing reaches a node, and the same
server still answers a greedy request with the same text afterwards."""

from __future__ import annotations

import math

import grpc
import pytest

from protos import api_pb2, common_pb2
from router.client import GenerationClient
from router.schemas import MAX_STOP_STRINGS
from tests.router_fakes import TOKENS, ScriptedBackend, make_router_model_dir
from tests.security.edge_server import EdgeServer

GENERATE = "/pdserve.v1.Generation/Generate"
LIST_MODELS = "/pdserve.v1.Generation/ListModels"
INVALID, TOO_BIG = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED


def G(text: str | None = "Hi", ids=None, **sampling) -> bytes:
    msg = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling))
    if ids is not None:
        msg.token_ids.ids.extend(ids)
    elif text is not None:
        msg.text = text
    return msg.SerializeToString()


def R(**fields) -> bytes:
    return api_pb2.GenerateRequest(**fields).SerializeToString()


# (id, method, request bytes, code, what the details must name)
CASES = [
    # -- bytes that do not decode
    ("garbage", GENERATE, b"\xff\xff\xff\xff", INVALID, "could not be decoded"),
    ("truncated-tag", GENERATE, b"\x0a", INVALID, "could not be decoded"),
    ("truncated-text", GENERATE, b"\x1a\x05ab", INVALID, "could not be decoded"),
    ("text-bad-utf8", GENERATE, b"\x1a\x02\xff\xfe", INVALID, "could not be decoded"),
    ("model-bad-utf8", GENERATE, b"\x12\x02\xc3\x28", INVALID, "could not be decoded"),
    ("request_id-surrogate-utf8", GENERATE, b"\x0a\x03\xed\xa0\x80", INVALID,
     "could not be decoded"),
    ("sampling-truncated", GENERATE, b"\x2a\x03\x08\xff", INVALID, "could not be decoded"),
    ("token_ids-truncated", GENERATE, b"\x22\x02\x0a\x05", INVALID, "could not be decoded"),
    ("bad-wire-type", GENERATE, b"\x0f", INVALID, "could not be decoded"),
    ("end-group-alone", GENERATE, b"\x0c", INVALID, "could not be decoded"),
    ("list-models-garbage", LIST_MODELS, b"\xff\xff", INVALID, "could not be decoded"),
    # -- size
    ("oversize", GENERATE, R(text="x" * (5 * 1024 * 1024)), TOO_BIG, ""),
    # -- prompt
    ("no-prompt", GENERATE, G(None), INVALID, "prompt"),
    ("empty-text", GENERATE, G(""), INVALID, "prompt is empty"),
    ("empty-token-ids", GENERATE, R(token_ids=api_pb2.TokenIds(ids=[])), INVALID, "prompt"),
    ("token-id-outside-vocab", GENERATE, G(ids=[1, 4000]), INVALID, "token_ids"),
    ("token-id-uint32-max", GENERATE, G(ids=[2**32 - 1]), INVALID, "token_ids"),
    ("text-too-many-chars", GENERATE, G("x" * 5000), INVALID, "text has 5000 characters"),
    ("text-too-many-tokens", GENERATE, G("the " * 70), INVALID, "prompt has"),
    ("ids-too-many-tokens", GENERATE, G(ids=list(range(3, 67))), INVALID, "prompt has 64"),
    ("model-unknown", GENERATE, R(model="other", text="x"), INVALID, "model"),
    ("model-long", GENERATE, R(model="m" * 5000, text="x"), INVALID, "model"),
    ("request_id-space", GENERATE, R(request_id="bad id", text="x"), INVALID, "request_id"),
    ("request_id-long", GENERATE, R(request_id="r" * 200, text="x"), INVALID, "request_id"),
    ("request_id-newline", GENERATE, R(request_id="a\nb", text="x"), INVALID, "request_id"),
    # -- sampling values the wire can carry but the engine or the context cannot take
    ("max_tokens-zero", GENERATE, G(max_tokens=0), INVALID, "max_tokens must be in [1,"),
    ("max_tokens-uint32-max", GENERATE, G(max_tokens=2**32 - 1), INVALID,
     "max_tokens must be in"),
    ("max_tokens-context", GENERATE, G(max_tokens=64), INVALID,
     "max_tokens); reduce the prompt or max_tokens"),
    ("temperature-negative", GENERATE, G(temperature=-1), INVALID, "temperature"),
    ("temperature-nan", GENERATE, G(temperature=math.nan), INVALID,
     "temperature must be a finite number"),
    ("temperature-inf", GENERATE, G(temperature=math.inf), INVALID, "temperature"),
    ("top_p-zero", GENERATE, G(top_p=0), INVALID, "top_p must be in (0, 1]"),
    ("top_p-over", GENERATE, G(top_p=1.5), INVALID, "top_p"),
    ("top_p-nan", GENERATE, G(top_p=math.nan), INVALID, "top_p"),
    ("top_k-minus-2", GENERATE, G(top_k=-2), INVALID, "top_k"),
    ("top_k-zero", GENERATE, G(top_k=0), INVALID, "top_k"),
    ("min_p-over", GENERATE, G(min_p=2), INVALID, "min_p"),
    ("min_p-negative", GENERATE, G(min_p=-0.5), INVALID, "min_p"),
    ("presence-over", GENERATE, G(presence_penalty=3), INVALID, "presence_penalty"),
    ("frequency-under", GENERATE, G(frequency_penalty=-3), INVALID, "frequency_penalty"),
    ("frequency-nan", GENERATE, G(frequency_penalty=math.nan), INVALID, "frequency_penalty"),
    ("repetition-zero", GENERATE, G(repetition_penalty=0), INVALID, "repetition_penalty"),
    ("repetition-inf", GENERATE, G(repetition_penalty=math.inf), INVALID,
     "repetition_penalty"),
    ("stop-empty", GENERATE, G(stop=[""]), INVALID, "stop[0] must not be empty"),
    ("stop-too-many", GENERATE, G(stop=["x"] * (MAX_STOP_STRINGS + 1)), INVALID, "stop"),
    ("stop-too-long", GENERATE, G(stop=["x" * 1025]), INVALID, "stop[0]"),
    ("stop_token_ids-vocab", GENERATE, G(stop_token_ids=[400]), INVALID, "stop_token_ids"),
    ("stop_token_ids-uint32-max", GENERATE, G(stop_token_ids=[2**32 - 1]), INVALID,
     "stop_token_ids"),
    ("logprobs-over", GENERATE, G(logprobs=21), INVALID, "logprobs must be in [0, 20]"),
    ("logprobs-uint32-max", GENERATE, G(logprobs=2**32 - 1), INVALID, "logprobs"),
]


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    model_dir = make_router_model_dir(tmp_path_factory.mktemp("router-model"))
    with EdgeServer(model_dir, ScriptedBackend(TOKENS)) as server:
        with GenerationClient(server.grpc_address, timeout=60) as client:
            server.client = client
            server.baseline = client.generate("Hello", max_tokens=8, temperature=0).text
            yield server


def _call_raw(address: str, method: str, raw: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        if method == GENERATE:
            call = channel.unary_stream(method, request_serializer=None,
                                        response_deserializer=None)
            with pytest.raises(grpc.RpcError) as info:
                for _ in call(raw, timeout=60):
                    pass
        else:
            call = channel.unary_unary(method, request_serializer=None,
                                       response_deserializer=None)
            with pytest.raises(grpc.RpcError) as info:
                call(raw, timeout=60)
    return info.value


@pytest.mark.parametrize("method,raw,code,named", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_malformed_request_is_refused_naming_the_field(edge, method, raw, code, named):
    before = len(edge.backend.requests)
    err = _call_raw(edge.grpc_address, method, raw)
    assert err.code() == code, err.details()
    assert named in (err.details() or ""), err.details()
    assert len(edge.backend.requests) == before, "a refused request reached a node"
    assert edge.client.generate("Hello", max_tokens=8, temperature=0).text == edge.baseline
    assert len(edge.backend.requests) == before + 1


def test_a_valid_raw_request_passes_the_decoding_guard(edge):
    """The guard swaps the deserializer: a good message must still arrive intact."""
    with grpc.insecure_channel(edge.grpc_address) as channel:
        call = channel.unary_stream(GENERATE, request_serializer=None,
                                    response_deserializer=api_pb2.GenerateResponse.FromString)
        out = list(call(G("Hello", max_tokens=8, temperature=0), timeout=60))
    assert "".join(r.text_delta for r in out) == edge.baseline
    assert edge.backend.requests[-1].params.max_tokens == 8
    assert len(CASES) >= 45
