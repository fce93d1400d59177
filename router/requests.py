"""Validation of OpenAI-style request bodies into one internal request.

Every client mistake becomes an `InvalidRequest` naming the parameter, before any node is
contacted. Sampling values are checked by the engine's own `SamplingParams`, so the router
and the nodes cannot disagree on what is valid.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.errors import InvalidRequest, ModelNotFound
from router.model_info import ModelInfo

# OpenAI body key -> SamplingParams field (vLLM's extra keys included).
_SAMPLING_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "seed": "seed",
    "skip_special_tokens": "skip_special_tokens",
}
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ParsedRequest:
    """One client request: one prompt per choice, shared sampling parameters."""
    kind: str                             # "completion" | "chat"
    request_id: str
    model: str
    prompts: list[list[int]]              # token ids, one entry per choice
    prompt_texts: list[str | None]        # the text each came from (None for token ids)
    params: list[SamplingParams]          # per choice (max_tokens may differ for chat)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    # vLLM's extension: token ids in the response (choices[].token_ids, prompt_token_ids)
    return_token_ids: bool = False


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def parse_body(body: object) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got "
                             f"{type(body).__name__}")
    # JSON null means "not given" (some clients send it for optional fields).
    return {k: v for k, v in body.items() if v is not None}


def _check_model(body: dict, info: ModelInfo) -> str:
    model = body.get("model")
    if model is None:
        raise InvalidRequest("'model' is required", "model")
    if not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, got {type(model).__name__}", "model")
    if model != info.name:
        raise ModelNotFound(f"the model {model!r} does not exist; this router serves "
                            f"{info.name!r}", "model")
    return model


def _check_unsupported(body: dict) -> None:
    n = body.get("n", 1)
    if n != 1:
        raise InvalidRequest(f"n must be 1 (one choice per prompt), got {n!r}", "n")
    best_of = body.get("best_of", 1)
    if best_of != 1:
        raise InvalidRequest(f"best_of must be 1, got {best_of!r}", "best_of")
    if body.get("logit_bias"):
        raise InvalidRequest("logit_bias is not supported", "logit_bias")
    if body.get("suffix"):
        raise InvalidRequest("suffix is not supported", "suffix")
    if body.get("tools") or body.get("functions"):
        raise InvalidRequest("tools / function calling are not supported", "tools")
    if not isinstance(body.get("stream", False), bool):
        raise InvalidRequest(f"stream must be a boolean, got {body['stream']!r}", "stream")
    opts = body.get("stream_options", {})
    if not isinstance(opts, dict):
        raise InvalidRequest("stream_options must be an object", "stream_options")


def build_sampling(body: dict, max_tokens: int, logprobs: int | None) -> SamplingParams:
    kwargs = {field_: body[key] for key, field_ in _SAMPLING_KEYS.items() if key in body}
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        name = message.split(" ", 1)[0]
        param = next((k for k, f in _SAMPLING_KEYS.items() if f == name),
                     name if name in ("max_tokens", "logprobs") else None)
        raise InvalidRequest(message, param) from None


def check_prompt(ids: list[int], info: ModelInfo, param: str) -> None:
    if not ids:
        raise InvalidRequest(f"{param} is empty: at least one token is required", param)
    if len(ids) >= info.max_model_len:
        raise InvalidRequest(
            f"{param} has {len(ids)} tokens, but the model's maximum length is "
            f"{info.max_model_len}: the prompt plus at least one generated token must fit",
            param)


def check_token_ids(ids: list, info: ModelInfo, param: str) -> list[int]:
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < info.vocab_size:
            raise InvalidRequest(f"{param} holds token id {t!r}, outside the vocabulary "
                                 f"[0, {info.vocab_size})", param)
    return list(ids)


def _max_tokens(body: dict, keys: tuple[str, ...], default: int | None) -> int | None:
    for key in keys:
        if key in body:
            value = body[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequest(f"{key} must be an integer >= 1, got {value!r}", key)
            return value
    return default


def parse_completion(body: object, info: ModelInfo, tok: Tokenizer,
                     request_id: str | None = None) -> ParsedRequest:
    body = parse_body(body)
    model = _check_model(body, info)
    _check_unsupported(body)
    if "prompt" not in body:
        raise InvalidRequest("'prompt' is required", "prompt")
    prompt = body["prompt"]
    # str | list[str] | list[int] | list[list[int]] (OpenAI's four shapes)
    if isinstance(prompt, str):
        items: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise InvalidRequest("prompt must be a non-empty string, a list of strings, a list of "
                             "token ids or a list of token-id lists", "prompt")
    prompts, texts = [], []
    for item in items:
        if isinstance(item, str):
            ids = tok.encode(item) if item else []
            texts.append(item)
        elif isinstance(item, list):
            ids = check_token_ids(item, info, "prompt")
            texts.append(None)
        else:
            raise InvalidRequest(f"prompt entries must be strings or token-id lists, got "
                                 f"{type(item).__name__}", "prompt")
        check_prompt(ids, info, "prompt")
        prompts.append(ids)
    logprobs = body.get("logprobs")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise InvalidRequest(f"echo must be a boolean, got {echo!r}", "echo")
    if echo and logprobs is not None:
        raise InvalidRequest("echo with logprobs is not supported (prompt logprobs are not "
                             "computed)", "echo")
    max_tokens = _max_tokens(body, ("max_tokens",), 16)
    params = build_sampling(body, max_tokens, logprobs)
    return ParsedRequest("completion", request_id or new_request_id(), model, prompts, texts,
                         [params] * len(prompts), stream=body.get("stream", False),
                         include_usage=bool(body.get("stream_options", {}).get("include_usage")),
                         echo=echo, return_token_ids=_flag(body, "return_token_ids"))


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} must be a boolean, got {value!r}", key)
    return value


def _message_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):       # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise InvalidRequest(f"messages[{index}].content parts must be "
                                     "{'type': 'text', 'text': str}", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"messages[{index}].content must be a string or a list of text parts",
                         "messages")


def parse_chat(body: object, info: ModelInfo, tok: Tokenizer,
               request_id: str | None = None) -> ParsedRequest:
    body = parse_body(body)
    model = _check_model(body, info)
    _check_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects",
                             "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, "
                                 f"got {role!r}", "messages")
        content = m.get("content")
        if content is None and role != "assistant":
            raise InvalidRequest(f"messages[{i}].content is required", "messages")
        clean.append({"role": role, "content": _message_text(content or "", i)})
    try:
        text = tok.apply_chat_template(clean, add_generation_prompt=True)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "messages") from None
    ids = tok.encode(text, add_special_tokens=False)
    check_prompt(ids, info, "messages")
    want_logprobs = body.get("logprobs", False)
    if not isinstance(want_logprobs, bool):
        raise InvalidRequest(f"logprobs must be a boolean, got {want_logprobs!r}", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not want_logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                            or not 0 <= top <= 20):
        raise InvalidRequest(f"top_logprobs must be an integer in [0, 20], got {top!r}",
                             "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    # vLLM's default: generate up to the model's length.
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"),
                             info.max_model_len - len(ids))
    params = build_sampling(body, max_tokens, logprobs)
    return ParsedRequest("chat", request_id or new_request_id(), model, [ids], [text],
                         [params], stream=body.get("stream", False),
                         include_usage=bool(body.get("stream_options", {}).get("include_usage")),
                         return_token_ids=_flag(body, "return_token_ids"))
