"""Malformed input at the HTTP edge: every case is refused with its 4xx status and an OpenAI
error body naming the field (`param`, and the message), nothing reaches a node, and the
same server still answers a greedy request with the same text afterwards."""

from __future__ import annotations

import pytest

from router.json_body import MAX_JSON_DEPTH
from router.schemas import INT32_MAX, MAX_MESSAGES, MAX_PROMPTS, MAX_STOP_STRINGS
from tests.router_fakes import TOKENS, ScriptedBackend, make_router_model_dir
from tests.security.edge_server import EdgeServer

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BODY_LIMIT = 256 * 1024
DROP = object()


def C(**over) -> dict:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
    body.update(over)
    return {k: v for k, v in body.items() if v is not DROP}


def CH(**over) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    body.update(over)
    return {k: v for k, v in body.items() if v is not DROP}


def user(content) -> list:
    return [{"role": "user", "content": content}]


def nested(depth: int) -> str:
    return '{"model": "tiny", "prompt": "Hi", "extra": ' + "[" * depth + "]" * depth + "}"


# (id, path, body, status, param: the field named, or None for the body as a whole,
#  a fragment of the message)
S = [
    # -- the body as a whole
    ("not-json", COMPLETIONS, "{not json", 400, None, "not valid JSON"),
    ("empty-body", COMPLETIONS, b"", 400, None, "not valid JSON"),
    ("array-body", COMPLETIONS, "[1, 2]", 400, None, "JSON object"),
    ("string-body", COMPLETIONS, '"hi"', 400, None, "JSON object"),
    ("null-body", COMPLETIONS, "null", 400, None, "JSON object"),
    ("bad-utf8", COMPLETIONS, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None,
     "not valid JSON"),
    ("nan", COMPLETIONS, '{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, None,
     "NaN is not a JSON value"),
    ("infinity", COMPLETIONS, '{"model": "tiny", "prompt": "x", "top_p": Infinity}', 400,
     None, "Infinity is not a JSON value"),
    ("huge-int-literal", COMPLETIONS, '{"model": "tiny", "prompt": "x", "seed": '
     + "9" * 5000 + "}", 400, None, "not valid JSON"),
    ("depth-over-limit", COMPLETIONS, nested(MAX_JSON_DEPTH + 1), 400, None, "nests"),
    ("depth-10000", COMPLETIONS, nested(10_000), 400, None, "nests"),
    ("depth-in-chat", CHAT, '{"model": "tiny", "messages": ' + "[" * 500 + "]" * 500 + "}",
     400, None, "nests"),
    ("too-large", COMPLETIONS, C(prompt="x" * BODY_LIMIT), 413, None, "larger than"),
    ("too-large-chat", CHAT, CH(messages=user("y" * (BODY_LIMIT + 10))), 413, None,
     "larger than"),
    # -- model
    ("model-missing", COMPLETIONS, C(model=DROP), 400, "model", "model is required"),
    ("model-int", COMPLETIONS, C(model=5), 400, "model", "model must be a string"),
    ("model-list", COMPLETIONS, C(model=["tiny"]), 400, "model", "model must be a string"),
    ("model-bool", CHAT, CH(model=True), 400, "model", "model must be a string"),
    ("model-unknown", COMPLETIONS, C(model="gpt-4"), 400, "model", "'gpt-4' does not exist"),
    ("model-surrogate", COMPLETIONS, C(model="ti\ud800ny"), 400, "model", "surrogate"),
    # -- prompt
    ("prompt-missing", COMPLETIONS, C(prompt=DROP), 400, "prompt", "prompt is required"),
    ("prompt-int", COMPLETIONS, C(prompt=5), 400, "prompt", "prompt must be a non-empty"),
    ("prompt-bool", COMPLETIONS, C(prompt=True), 400, "prompt", "prompt must be a non-empty"),
    ("prompt-object", COMPLETIONS, C(prompt={"text": "x"}), 400, "prompt", "must be a"),
    ("prompt-empty-list", COMPLETIONS, C(prompt=[]), 400, "prompt", "prompt must be"),
    ("prompt-empty-string", COMPLETIONS, C(prompt=""), 400, "prompt", "prompt is empty"),
    ("prompt-empty-ids", COMPLETIONS, C(prompt=[[]]), 400, "prompt",
     "prompt[0] must be a non-empty list"),
    ("prompt-float-id", COMPLETIONS, C(prompt=[1.5]), 400, "prompt", "prompt[0] must be a"),
    ("prompt-bool-id", COMPLETIONS, C(prompt=[1, True]), 400, "prompt",
     "prompt[1] must be an integer"),
    ("prompt-str-in-ids", COMPLETIONS, C(prompt=[5, "a"]), 400, "prompt",
     "prompt[1] must be an integer"),
    ("prompt-mixed-batch", COMPLETIONS, C(prompt=["a", 5]), 400, "prompt",
     "prompt[1] must be a string or a list of token ids"),
    ("prompt-nested-str", COMPLETIONS, C(prompt=[["a"]]), 400, "prompt",
     "prompt[0][0] must be an integer"),
    ("prompt-negative-id", COMPLETIONS, C(prompt=[-1]), 400, "prompt", "prompt[0] must be in"),
    ("prompt-id-over-uint32", COMPLETIONS, C(prompt=[2**32]), 400, "prompt",
     "prompt[0] must be in"),
    ("prompt-id-2**70", COMPLETIONS, C(prompt=[2**70]), 400, "prompt", "prompt[0] must be in"),
    ("prompt-id-outside-vocab", COMPLETIONS, C(prompt=[1, 999]), 400, "prompt",
     "outside the vocab"),
    ("prompt-batch-id-outside", COMPLETIONS, C(prompt=[[1], [320]]), 400, "prompt",
     "outside the vocab"),
    ("prompt-surrogate", COMPLETIONS, C(prompt="a\ud800b"), 400, "prompt", "lone UTF-16"),
    ("prompt-low-surrogate", COMPLETIONS, C(prompt=["ok", "\udfff"]), 400, "prompt",
     "lone UTF-16"),
    ("prompt-too-many-tokens", COMPLETIONS, C(prompt=list(range(3, 67))), 400, "prompt",
     "maximum length is 64"),
    ("prompt-too-many-chars", COMPLETIONS, C(prompt="x" * 5000), 400, "prompt",
     "characters"),
    ("prompt-batch-too-many", COMPLETIONS, C(prompt=["a"] * (MAX_PROMPTS + 1)), 400,
     "prompt", f"at most {MAX_PROMPTS} items"),
    # -- max_tokens and the context
    ("max_tokens-str", COMPLETIONS, C(max_tokens="16"), 400, "max_tokens",
     "max_tokens must be an integer"),
    ("max_tokens-float", COMPLETIONS, C(max_tokens=1.5), 400, "max_tokens", "an integer"),
    ("max_tokens-bool", COMPLETIONS, C(max_tokens=True), 400, "max_tokens", "an integer"),
    ("max_tokens-list", COMPLETIONS, C(max_tokens=[4]), 400, "max_tokens", "an integer"),
    ("max_tokens-zero", COMPLETIONS, C(max_tokens=0), 400, "max_tokens", "must be in [1,"),
    ("max_tokens-negative", COMPLETIONS, C(max_tokens=-1), 400, "max_tokens", "must be in"),
    ("max_tokens-2**31", COMPLETIONS, C(max_tokens=INT32_MAX + 1), 400, "max_tokens",
     "must be in"),
    ("max_tokens-2**40", COMPLETIONS, C(max_tokens=2**40), 400, "max_tokens", "must be in"),
    ("max_tokens-2**70", COMPLETIONS, C(max_tokens=2**70), 400, "max_tokens", "must be in"),
    ("max_tokens-context", COMPLETIONS, C(max_tokens=64), 400, "max_tokens",
     "maximum context length is 64"),
    ("chat-max_tokens-context", CHAT, CH(max_tokens=60), 400, "max_tokens",
     "maximum context length"),
    ("max_completion_tokens-context", CHAT, CH(max_tokens=DROP, max_completion_tokens=100),
     400, "max_completion_tokens", "maximum context length"),
    ("max_completion_tokens-zero", CHAT, CH(max_completion_tokens=0), 400,
     "max_completion_tokens", "must be in"),
    ("max_completion_tokens-str", CHAT, CH(max_completion_tokens="5"), 400,
     "max_completion_tokens", "an integer"),
    ("max_completion_tokens-2**40", CHAT, CH(max_completion_tokens=2**40), 400,
     "max_completion_tokens", "must be in"),
    # -- sampling numbers
    ("temperature-str", COMPLETIONS, C(temperature="0"), 400, "temperature", "a number"),
    ("temperature-bool", COMPLETIONS, C(temperature=True), 400, "temperature", "a number"),
    ("temperature-negative", COMPLETIONS, C(temperature=-1), 400, "temperature", ">= 0"),
    ("temperature-list", CHAT, CH(temperature=[0]), 400, "temperature", "a number"),
    ("temperature-object", CHAT, CH(temperature={"v": 1}), 400, "temperature", "a number"),
    ("top_p-zero", COMPLETIONS, C(top_p=0), 400, "top_p", "in (0, 1]"),
    ("top_p-over", COMPLETIONS, C(top_p=1.5), 400, "top_p", "in (0, 1]"),
    ("top_p-str", COMPLETIONS, C(top_p="1"), 400, "top_p", "a number"),
    ("top_p-bool", CHAT, CH(top_p=False), 400, "top_p", "a number"),
    ("top_k-zero", COMPLETIONS, C(top_k=0), 400, "top_k", "top_k must be -1"),
    ("top_k-minus-2", COMPLETIONS, C(top_k=-2), 400, "top_k", "must be in [-1,"),
    ("top_k-float", COMPLETIONS, C(top_k=1.5), 400, "top_k", "an integer"),
    ("top_k-str", COMPLETIONS, C(top_k="5"), 400, "top_k", "an integer"),
    ("top_k-2**40", COMPLETIONS, C(top_k=2**40), 400, "top_k", "must be in"),
    ("min_p-negative", COMPLETIONS, C(min_p=-0.1), 400, "min_p", "in [0, 1]"),
    ("min_p-over", COMPLETIONS, C(min_p=2), 400, "min_p", "in [0, 1]"),
    ("min_p-str", CHAT, CH(min_p="x"), 400, "min_p", "a number"),
    ("presence-over", COMPLETIONS, C(presence_penalty=3), 400, "presence_penalty",
     "in [-2, 2]"),
    ("presence-under", COMPLETIONS, C(presence_penalty=-3), 400, "presence_penalty",
     "in [-2, 2]"),
    ("presence-str", CHAT, CH(presence_penalty="1"), 400, "presence_penalty", "a number"),
    ("frequency-over", COMPLETIONS, C(frequency_penalty=2.5), 400, "frequency_penalty",
     "in [-2, 2]"),
    ("frequency-bool", COMPLETIONS, C(frequency_penalty=True), 400, "frequency_penalty",
     "a number"),
    ("repetition-zero", COMPLETIONS, C(repetition_penalty=0), 400, "repetition_penalty",
     "> 0"),
    ("repetition-negative", COMPLETIONS, C(repetition_penalty=-1), 400, "repetition_penalty",
     "> 0"),
    ("repetition-str", CHAT, CH(repetition_penalty="1"), 400, "repetition_penalty",
     "a number"),
    ("seed-2**70", COMPLETIONS, C(seed=2**70), 400, "seed", "must be in"),
    ("seed-minus-2**70", COMPLETIONS, C(seed=-(2**70)), 400, "seed", "must be in"),
    ("seed-2**63", CHAT, CH(seed=2**63), 400, "seed", "must be in"),
    ("seed-str", COMPLETIONS, C(seed="1"), 400, "seed", "an integer"),
    ("seed-float", COMPLETIONS, C(seed=1.5), 400, "seed", "an integer"),
    ("logprobs-over", COMPLETIONS, C(logprobs=21), 400, "logprobs", "in [0, 20]"),
    ("logprobs-negative", COMPLETIONS, C(logprobs=-1), 400, "logprobs", "in [0, 20]"),
    ("logprobs-str", COMPLETIONS, C(logprobs="1"), 400, "logprobs", "an integer"),
    ("logprobs-bool-completions", COMPLETIONS, C(logprobs=True), 400, "logprobs",
     "an integer"),
    # -- stop
    ("stop-int", COMPLETIONS, C(stop=5), 400, "stop", "stop must be a string or a list"),
    ("stop-bool", COMPLETIONS, C(stop=True), 400, "stop", "stop must be a string or a list"),
    ("stop-object", CHAT, CH(stop={"a": 1}), 400, "stop", "stop must be a string or a list"),
    ("stop-int-item", COMPLETIONS, C(stop=[5]), 400, "stop", "stop[0] must be a string"),
    ("stop-null-item", COMPLETIONS, C(stop=["a", None]), 400, "stop",
     "stop[1] must be a string"),
    ("stop-empty", COMPLETIONS, C(stop=[""]), 400, "stop", "stop[0] must not be empty"),
    ("stop-empty-str", CHAT, CH(stop=""), 400, "stop", "stop must not be empty"),
    ("stop-too-many", COMPLETIONS, C(stop=["x"] * (MAX_STOP_STRINGS + 1)), 400, "stop",
     "at most"),
    ("stop-too-long", COMPLETIONS, C(stop=["x" * 1025]), 400, "stop", "at most 1024"),
    ("stop-surrogate", COMPLETIONS, C(stop=["\ud83d"]), 400, "stop", "lone UTF-16"),
    ("stop_token_ids-int", COMPLETIONS, C(stop_token_ids=5), 400, "stop_token_ids",
     "must be a list"),
    ("stop_token_ids-negative", COMPLETIONS, C(stop_token_ids=[-1]), 400, "stop_token_ids",
     "stop_token_ids[0] must be in"),
    ("stop_token_ids-vocab", COMPLETIONS, C(stop_token_ids=[400]), 400, "stop_token_ids",
     "outside the vocab"),
    ("stop_token_ids-str", CHAT, CH(stop_token_ids=["1"]), 400, "stop_token_ids",
     "an integer"),
    ("stop_token_ids-2**40", COMPLETIONS, C(stop_token_ids=[2**40]), 400, "stop_token_ids",
     "must be in"),
    # -- booleans
    ("ignore_eos-yes", COMPLETIONS, C(ignore_eos="yes"), 400, "ignore_eos",
     "ignore_eos must be a boolean, got 'yes'"),
    ("ignore_eos-int", COMPLETIONS, C(ignore_eos=1), 400, "ignore_eos", "a boolean"),
    ("ignore_eos-true-str", CHAT, CH(ignore_eos="true"), 400, "ignore_eos", "a boolean"),
    ("skip_special-no", COMPLETIONS, C(skip_special_tokens="no"), 400,
     "skip_special_tokens", "a boolean"),
    ("skip_special-zero", CHAT, CH(skip_special_tokens=0), 400, "skip_special_tokens",
     "a boolean"),
    ("stream-yes", COMPLETIONS, C(stream="yes"), 400, "stream", "a boolean"),
    ("stream-int", CHAT, CH(stream=1), 400, "stream", "a boolean"),
    ("echo-str", COMPLETIONS, C(echo="yes"), 400, "echo", "a boolean"),
    ("echo-with-logprobs", COMPLETIONS, C(echo=True, logprobs=1), 400, "echo",
     "not supported"),
    ("return_token_ids-str", COMPLETIONS, C(return_token_ids="yes"), 400, "return_token_ids",
     "a boolean"),
    ("stream_options-int", COMPLETIONS, C(stream_options=5), 400, "stream_options",
     "an object"),
    ("include_usage-str", COMPLETIONS, C(stream=True, stream_options={"include_usage": "y"}),
     400, "stream_options", "stream_options.include_usage must be a boolean"),
    # -- unsupported / OpenAI extras
    ("n-17", COMPLETIONS, C(n=17), 400, "n", "n must be in [1, 16]"),
    ("n-0", CHAT, CH(n=0), 400, "n", "n must be in [1, 16]"),
    ("n-str", COMPLETIONS, C(n="1"), 400, "n", "an integer"),
    ("best_of-2", COMPLETIONS, C(best_of=2), 400, "best_of", "best_of must be 1"),
    ("logit_bias-used", COMPLETIONS, C(logit_bias={"1": 5}), 400, "logit_bias",
     "not supported"),
    ("logit_bias-int", CHAT, CH(logit_bias=5), 400, "logit_bias", "an object"),
    ("suffix-used", COMPLETIONS, C(suffix="x"), 400, "suffix", "not supported"),
    ("suffix-int", COMPLETIONS, C(suffix=5), 400, "suffix", "a string"),
    ("user-int", COMPLETIONS, C(user=5), 400, "user", "a string"),
    ("tools-used", CHAT, CH(tools=[{"type": "function"}]), 400, "tools", "not supported"),
    ("tools-str", CHAT, CH(tools="x"), 400, "tools", "a list"),
    ("functions-used", CHAT, CH(functions=[{}]), 400, "functions", "not supported"),
    # -- chat messages
    ("messages-missing", CHAT, CH(messages=DROP), 400, "messages", "messages is required"),
    ("messages-empty", CHAT, CH(messages=[]), 400, "messages",
     "messages must be a non-empty list"),
    ("messages-str", CHAT, CH(messages="hi"), 400, "messages", "a list"),
    ("messages-int-item", CHAT, CH(messages=[5]), 400, "messages",
     "messages[0] must be an object"),
    ("messages-role-int", CHAT, CH(messages=[{"role": 5, "content": "x"}]), 400, "messages",
     "messages[0].role must be one of"),
    ("messages-role-unknown", CHAT, CH(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages", "messages[0].role must be one of"),
    ("messages-role-missing", CHAT, CH(messages=[{"content": "x"}]), 400, "messages",
     "messages[0].role is required"),
    ("messages-content-missing", CHAT, CH(messages=[{"role": "user"}]), 400, "messages",
     "messages[0].content is required"),
    ("messages-content-int", CHAT, CH(messages=user(5)), 400, "messages",
     "messages[0].content must be a string or a list"),
    ("messages-part-int", CHAT, CH(messages=user([5])), 400, "messages",
     "messages[0].content[0] must be an object"),
    ("messages-part-image", CHAT, CH(messages=user([{"type": "image_url", "image_url": {}}])),
     400, "messages", "messages[0].content[0].type must be one of"),
    ("messages-part-text-int", CHAT, CH(messages=user([{"type": "text", "text": 5}])), 400,
     "messages", "messages[0].content[0].text must be a string"),
    ("messages-surrogate", CHAT, CH(messages=user("hi \udc00")), 400, "messages",
     "lone UTF-16"),
    ("messages-name-int", CHAT, CH(messages=[{"role": "user", "content": "x", "name": 5}]),
     400, "messages", "messages[0].name must be a string"),
    ("messages-too-many-chars", CHAT, CH(messages=user("z" * 5000)), 400, "messages",
     "characters"),
    ("messages-too-many-tokens", CHAT, CH(messages=user("the " * 70)), 400, "messages",
     "maximum length is 64"),
    ("messages-too-many", CHAT, CH(messages=user("a") * (MAX_MESSAGES + 1)), 400,
     "messages", f"at most {MAX_MESSAGES} items"),
    ("chat-logprobs-str", CHAT, CH(logprobs="yes"), 400, "logprobs", "a boolean"),
    ("chat-logprobs-int", CHAT, CH(logprobs=1), 400, "logprobs", "a boolean"),
    ("top_logprobs-without", CHAT, CH(top_logprobs=2), 400, "top_logprobs",
     "needs logprobs"),
    ("top_logprobs-over", CHAT, CH(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "in [0, 20]"),
    ("top_logprobs-str", CHAT, CH(logprobs=True, top_logprobs="1"), 400, "top_logprobs",
     "an integer"),
]
HEADER_CASES = [
    ("request-id-too-long", {"X-Request-Id": "r" * 200}, "request_id"),
    ("request-id-space", {"X-Request-Id": "bad id"}, "request_id"),
    ("request-id-quote", {"X-Request-Id": "a'b\"c"}, "request_id"),
]


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    model_dir = make_router_model_dir(tmp_path_factory.mktemp("router-model"))
    with EdgeServer(model_dir, ScriptedBackend(TOKENS), max_body_bytes=BODY_LIMIT) as server:
        server.baseline = server.greedy_text()
        yield server


def _refused_then_still_serving(edge, path, body, status, param, fragment, headers=None):
    before = len(edge.backend.requests)
    got, err, _ = edge.http("POST", path, body, headers)
    assert got == status, err
    assert set(err) == {"error"}
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param
    assert err["error"]["code"] == status
    assert err["error"]["type"] == "invalid_request_error"
    assert fragment in err["error"]["message"], err["error"]["message"]
    if param is not None:
        # the field is named in the message too, not only in `param`
        assert param in err["error"]["message"]
    assert len(edge.backend.requests) == before, "a refused request reached a node"
    assert edge.greedy_text() == edge.baseline
    assert len(edge.backend.requests) == before + 1


@pytest.mark.parametrize("path,body,status,param,fragment", [c[1:] for c in S],
                         ids=[c[0] for c in S])
def test_malformed_body_is_refused_naming_the_field(edge, path, body, status, param,
                                                    fragment):
    _refused_then_still_serving(edge, path, body, status, param, fragment)


@pytest.mark.parametrize("headers,param", [c[1:] for c in HEADER_CASES],
                         ids=[c[0] for c in HEADER_CASES])
def test_bad_request_id_header_is_refused(edge, headers, param):
    _refused_then_still_serving(edge, COMPLETIONS, C(), 400, param, "request_id must be",
                                headers)


def test_the_table_is_big_enough_and_the_baseline_is_real(edge):
    assert len(S) + len(HEADER_CASES) >= 150
    assert edge.baseline != "" and edge.greedy_text() == edge.baseline
