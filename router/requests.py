"""Validation of OpenAI-style request bodies into one internal request.

Every client mistake becomes an `InvalidRequest` naming the parameter, before any node is
contacted. The order matters for cost: the declared schemas (`router/schemas.py`: types,
ranges, list sizes) first, then the prompt's length in characters against a bound that no
fitting prompt can exceed (so a huge text is refused before it is tokenized), then the
tokenizer, then the limits that need token counts (the model's context). Sampling values
are finally checked by the engine's own `SamplingParams`, so the router and the nodes
cannot disagree on what is valid.

These functions block (tokenizing a long prompt takes a while): the fronts run them off the
event loop.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from dataclasses import dataclass, field
from functools import lru_cache

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.errors import InvalidRequest, ModelNotFound
from router.model_info import ModelInfo
from router.schema_errors import validate
from router.schemas import MAX_PROMPTS, ChatBody, CompletionBody, SamplingFields

DEFAULT_COMPLETION_MAX_TOKENS = 16          # OpenAI's and vLLM's default for completions
# Request ids travel into log lines and node calls: short, and nothing that could forge a
# log line or a metadata value.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def new_internal_id() -> str:
    """The router's own id for a request: 128 random bits, never taken from a client."""
    return uuid.uuid4().hex


@dataclass
class ParsedRequest:
    """One client request: one prompt per choice, shared sampling parameters.

    `request_id` is the client's (X-Request-Id / request_id) or a fresh one: it is only
    echoed back and written to logs. Everything sent to the nodes is named by `internal_id`,
    made here for every request, because two clients may choose the same id and the nodes
    key requests, reservations and aborts by the id they are sent."""
    kind: str                             # "completion" | "chat"
    request_id: str
    model: str
    prompts: list[list[int]]              # token ids, one entry per choice
    prompt_texts: list[str | None]        # the text each came from (None for token ids)
    params: list[SamplingParams]          # per choice (max_tokens may differ)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    # vLLM's extension: token ids in the response (choices[].token_ids, prompt_token_ids)
    return_token_ids: bool = False
    internal_id: str = field(default_factory=new_internal_id)
    # choices per prompt: `prompts` holds each prompt n times in a row (choice i * n + j is
    # prompt i's j-th), as OpenAI numbers the choices
    n: int = 1


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def check_request_id(value: str | None) -> str:
    if not value:
        return new_request_id()
    if not _REQUEST_ID.fullmatch(value):
        raise InvalidRequest("request_id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
                             "request_id")
    return value


def parse_body(body: object) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got "
                             f"{type(body).__name__}")
    # JSON null means "not given" (some clients send it for optional fields).
    return {k: v for k, v in body.items() if v is not None}


@lru_cache(maxsize=16)
def max_token_chars(tok: Tokenizer) -> int:
    """The most characters one token can stand for: its longest vocabulary entry (byte-level
    and metaspace vocabularies spell a token with at least as many characters as it
    decodes to). engine/ has no public accessor for the vocabulary, hence `_tok`."""
    vocab = tok._tok.get_vocab(with_added_tokens=True)
    return max((len(t) for t in vocab), default=1)


def check_chars(n_chars: int, info: ModelInfo, tok: Tokenizer, param: str) -> None:
    """Refuse, before tokenizing, a text that cannot fit: each token covers at most
    `max_token_chars` characters, so more than max_model_len times that is too many tokens."""
    limit = info.max_model_len * max_token_chars(tok)
    if n_chars > limit:
        raise InvalidRequest(f"{param} has {n_chars} characters, more than the "
                             f"{info.max_model_len} tokens the model takes can hold (at most "
                             f"{limit} characters)", param)


def _check_model(model: str, info: ModelInfo) -> str:
    if model != info.name:
        raise ModelNotFound(f"the model {model[:100]!r} does not exist; this router serves "
                            f"{info.name!r}", "model")
    return model


def build_sampling(fields: dict, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **fields)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        name = message.split(" ", 1)[0]
        param = name if name in SamplingFields.model_fields or name == "logprobs" else None
        raise InvalidRequest(message, param) from None


def check_prompt(ids: list[int], info: ModelInfo, param: str) -> None:
    if not ids:
        raise InvalidRequest(f"{param} is empty: at least one token is required", param)
    if len(ids) >= info.max_model_len:
        raise InvalidRequest(
            f"{param} has {len(ids)} tokens, but the model's maximum length is "
            f"{info.max_model_len}: the prompt plus at least one generated token must fit",
            param)


def check_token_ids(ids: list[int], info: ModelInfo, param: str) -> list[int]:
    for t in ids:
        if not 0 <= t < info.vocab_size:
            raise InvalidRequest(f"{param} holds token id {t!r}, outside the vocabulary "
                                 f"[0, {info.vocab_size})", param)
    return list(ids)


def max_tokens_for(prompt_len: int, asked: int | None, param: str, info: ModelInfo,
                   default: int | None) -> int:
    """The tokens to generate: what was asked, which must fit in the context with the prompt
    (vLLM refuses what does not), or the default cut to the room left."""
    room = info.max_model_len - prompt_len
    if asked is None:
        return room if default is None else min(default, room)
    if asked > room:
        raise InvalidRequest(
            f"this model's maximum context length is {info.max_model_len} tokens, but "
            f"{prompt_len + asked} were requested ({prompt_len} in the prompt, {asked} in "
            f"{param}); reduce the prompt or {param}", param)
    return asked


def sampling_from_fields(s: SamplingFields, info: ModelInfo) -> dict:
    fields = s.sampling_kwargs()
    if "stop_token_ids" in fields:
        check_token_ids(fields["stop_token_ids"], info, "stop_token_ids")
    return fields


def with_choices(req: ParsedRequest, n: int) -> ParsedRequest:
    """Each prompt's choice repeated n times in a row. With a seed, choice j samples with
    seed + j: the same seed would make every choice the same."""
    if n == 1:
        return req
    if len(req.prompts) * n > MAX_PROMPTS:
        raise InvalidRequest(f"{len(req.prompts)} prompts x n = {n} make "
                             f"{len(req.prompts) * n} choices, more than the {MAX_PROMPTS} "
                             f"one request may ask for", "n")
    params = []
    for sp in req.params:
        for j in range(n):
            params.append(sp if sp.seed is None or j == 0
                          else dataclasses.replace(sp, seed=sp.seed + j))
    return dataclasses.replace(
        req, prompts=[p for p in req.prompts for _ in range(n)],
        prompt_texts=[t for t in req.prompt_texts for _ in range(n)], params=params, n=n)


def parse_completion(body: object, info: ModelInfo, tok: Tokenizer,
                     request_id: str | None = None) -> ParsedRequest:
    b = validate(CompletionBody, parse_body(body))
    model = _check_model(b.model, info)
    items = b.prompt_items()
    for item in items:                          # all of them before any is tokenized
        if isinstance(item, str):
            check_chars(len(item), info, tok, "prompt")
    prompts, texts = [], []
    for item in items:
        if isinstance(item, str):
            ids = tok.encode(item) if item else []
            texts.append(item)
        else:
            ids = check_token_ids(item, info, "prompt")
            texts.append(None)
        check_prompt(ids, info, "prompt")
        prompts.append(ids)
    fields = sampling_from_fields(b, info)
    params = [build_sampling(fields, max_tokens_for(len(ids), b.max_tokens, "max_tokens", info,
                                                    DEFAULT_COMPLETION_MAX_TOKENS), b.logprobs)
              for ids in prompts]
    return with_choices(ParsedRequest(
        "completion", check_request_id(request_id), model, prompts, texts, params,
        stream=b.stream, include_usage=b.include_usage, echo=b.echo,
        return_token_ids=b.return_token_ids), b.n)


def parse_chat(body: object, info: ModelInfo, tok: Tokenizer,
               request_id: str | None = None) -> ParsedRequest:
    b = validate(ChatBody, parse_body(body))
    model = _check_model(b.model, info)
    clean = [{"role": m.role, "content": m.text()} for m in b.messages]
    check_chars(sum(len(m["content"]) for m in clean), info, tok, "messages")
    try:
        text = tok.apply_chat_template(clean, add_generation_prompt=True)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "messages") from None
    ids = tok.encode(text, add_special_tokens=False)
    check_prompt(ids, info, "messages")
    logprobs = (b.top_logprobs or 0) if b.logprobs else None
    asked, key = ((b.max_completion_tokens, "max_completion_tokens")
                  if b.max_completion_tokens is not None else (b.max_tokens, "max_tokens"))
    # vLLM's default for chat: generate up to the model's length.
    max_tokens = max_tokens_for(len(ids), asked, key, info, None)
    params = build_sampling(sampling_from_fields(b, info), max_tokens, logprobs)
    return with_choices(ParsedRequest(
        "chat", check_request_id(request_id), model, [ids], [text], [params],
        stream=b.stream, include_usage=b.include_usage,
        return_token_ids=b.return_token_ids), b.n)
