"""The public request bodies as declared pydantic v2 schemas (strict: no coercion).

Every field a client may send has a declared type and range, checked before anything else
touches the value: a bool is not an integer, "yes" is not a bool, 2**40 is not a max_tokens
the protobuf wire (uint32) or the engine could take, and a lone UTF-16 surrogate is not text
a tokenizer or a gRPC string can carry. A failure becomes `InvalidRequest` naming the field
(`router/schema_errors.py`). The engine's `SamplingParams` still validates afterwards, so the
router and the nodes cannot disagree on what is valid; the ranges here only make sure no
value reaches it (or the wire) that could overflow or crash on the way.

Unknown keys are ignored, as OpenAI and vLLM do (clients send `user`, `metadata`, ...); they
are never read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

# The wire's integer widths (protos/common.proto): values beyond them cannot be sent to a
# node, so they are refused here rather than failing inside the protobuf conversion.
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Edge limits on list sizes: generous for real use, small enough that one request cannot
# fan out into thousands of backend streams or stop-string scans.
MAX_PROMPTS = 128               # completions batch: one backend stream each
MAX_N = 16                      # choices per prompt (n); prompts x n <= MAX_PROMPTS
MAX_MESSAGES = 1024
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024           # per stop string (the stream holds back longest - 1 chars)
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20               # the engine's limit (SamplingParams)


def _no_lone_surrogates(text: str) -> str:
    # JSON's "\ud800" decodes to a Python str no UTF-8 encoder (tokenizer, protobuf) accepts.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "lone_surrogate", "holds a lone UTF-16 surrogate at character {pos}, which is not "
            "valid Unicode text", {"pos": exc.start}) from None
    return text


Text = Annotated[str, Strict(), AfterValidator(_no_lone_surrogates)]
Bool = Annotated[bool, Strict()]


def _bounded(ge=None, gt=None, le=None, lt=None) -> AfterValidator:
    """A range check whose message states the whole range ("top_p must be in (0, 1]"), not
    only the bound that failed, as pydantic's own constraints would."""
    lo, hi = (ge, "[") if gt is None else (gt, "("), (le, "]") if lt is None else (lt, ")")
    if lo[0] is not None and lo[0] == hi[0]:
        text = f"{lo[0]}"
    elif lo[0] is not None and hi[0] is not None:
        text = f"in {lo[1]}{lo[0]}, {hi[0]}{hi[1]}"
    else:
        text = (f">= {ge}" if ge is not None else f"> {gt}" if gt is not None
                else f"<= {le}" if le is not None else f"< {lt}")

    def check(value):
        if ((ge is not None and not value >= ge) or (gt is not None and not value > gt)
                or (le is not None and not value <= le) or (lt is not None and not value < lt)):
            raise PydanticCustomError("range", "must be " + text)
        return value
    return AfterValidator(check)


def Int(lo: int, hi: int) -> Any:  # noqa: N802 - reads as a type in the declarations
    return Annotated[int, Strict(), _bounded(ge=lo, le=hi)]


def Num(**bounds: float) -> Any:  # noqa: N802
    # Strict floats still take JSON integers (temperature: 0); NaN / Infinity (which Python's
    # json module accepts) are refused: `not x > 0` style checks let them through otherwise.
    return Annotated[float, Strict(), Field(allow_inf_nan=False), _bounded(**bounds)]


TokenId = Int(0, UINT32_MAX)          # the vocabulary check needs the model: requests.py


def _shape(value: Any, tags: dict[type, str]) -> str | None:
    for kind, tag in tags.items():
        if isinstance(value, kind) and not isinstance(value, bool):
            return tag
    return None


def _union(*branches: tuple[str, Any], pick, error: str, message: str) -> Any:
    """A union picked by the value's shape: only the matching branch's errors are reported,
    and a value of no known shape gets one message naming the accepted shapes."""
    members = tuple(Annotated[t, Tag(tag)] for tag, t in branches)
    union = members[0]
    for m in members[1:]:
        union = union | m
    return Annotated[union, Discriminator(pick, custom_error_type=error,
                                          custom_error_message=message)]


Stop = _union(("<one>", Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]),
              ("<list>", Annotated[list[Annotated[Text, Field(min_length=1,
                                                              max_length=MAX_STOP_CHARS)]],
                                   Field(max_length=MAX_STOP_STRINGS)]),
              pick=lambda v: _shape(v, {str: "<one>", list: "<list>"}), error="stop_shape",
              message="must be a string or a list of strings")

_IdList = Annotated[list[TokenId], Field(min_length=1)]


def _pick_prompt(value: Any) -> str | None:
    if isinstance(value, str):
        return "<text>"
    if isinstance(value, list) and value:
        first = value[0]
        return "<ids>" if isinstance(first, int) and not isinstance(first, bool) else "<batch>"
    return None


_BatchItem = _union(("<text>", Text), ("<ids>", _IdList),
                    pick=lambda v: _shape(v, {str: "<text>", list: "<ids>"}),
                    error="prompt_item", message="must be a string or a list of token ids")
Prompt = _union(("<text>", Text), ("<ids>", _IdList),
                ("<batch>", Annotated[list[_BatchItem], Field(max_length=MAX_PROMPTS)]),
                pick=_pick_prompt, error="prompt_shape",
                message="must be a non-empty string, a list of strings, a list of token ids or "
                "a list of token-id lists")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class SamplingFields(_Strict):
    """The sampling keys shared by both HTTP bodies and the gRPC SamplingParams message
    (OpenAI names plus vLLM's extras). Unset (or JSON null) = the engine's default."""

    max_tokens: Int(1, INT32_MAX) | None = None
    temperature: Num(ge=0) | None = None
    top_p: Num(gt=0, le=1) | None = None
    top_k: Int(-1, INT32_MAX) | None = None
    min_p: Num(ge=0, le=1) | None = None
    presence_penalty: Num(ge=-2, le=2) | None = None
    frequency_penalty: Num(ge=-2, le=2) | None = None
    repetition_penalty: Num(gt=0) | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: Bool | None = None
    seed: Int(INT64_MIN, INT64_MAX) | None = None
    skip_special_tokens: Bool | None = None

    def sampling_kwargs(self) -> dict:
        """The set sampling fields (max_tokens and logprobs excluded: the fronts decide them)."""
        return {k: v for k, v in self.model_dump(exclude_none=True).items()
                if k in _SAMPLING_NAMES}


_SAMPLING_NAMES = frozenset(SamplingFields.model_fields) - {"max_tokens"}


class StreamOptions(_Strict):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False      # accepted (vLLM), not acted on


def _unsupported(what: str) -> AfterValidator:
    # Declared (so a wrong type is still named) but refused when actually used.
    def check(value):
        if value:
            raise PydanticCustomError("unsupported", what)
        return value
    return AfterValidator(check)


class _OpenAIBody(SamplingFields):
    model: Text
    stream: Bool = False
    stream_options: StreamOptions | None = None
    n: Int(1, MAX_N) = 1                     # choices per prompt
    user: Text | None = None
    return_token_ids: Bool = False            # vLLM's extension: token ids in the response
    logit_bias: Annotated[dict[Text, Num(ge=-100, le=100)],
                          _unsupported("is not supported")] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(_OpenAIBody):
    prompt: Prompt
    echo: Bool = False
    logprobs: Int(0, MAX_LOGPROBS) | None = None
    best_of: Int(1, 1) = 1
    suffix: Annotated[Text, _unsupported("is not supported")] | None = None

    @model_validator(mode="after")
    def _echo_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise PydanticCustomError("unsupported", "with logprobs is not supported "
                                      "(prompt logprobs are not computed)", {"param": "echo"})
        return self

    def prompt_items(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


Content = _union(("<text>", Text), ("<parts>", Annotated[list[TextPart], Field(min_length=0)]),
                 pick=lambda v: _shape(v, {str: "<text>", list: "<parts>"}),
                 error="content_shape",
                 message="must be a string or a list of {type: text, text} parts")


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: Text | None = None

    @model_validator(mode="after")
    def _content_needed(self):
        # An assistant turn may carry only tool calls (content null); no other role may.
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing", "is required", {"field": "content"})
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatBody(_OpenAIBody):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Int(1, INT32_MAX) | None = None
    logprobs: Bool = False
    top_logprobs: Int(0, MAX_LOGPROBS) | None = None
    tools: Annotated[list[Any], _unsupported("is not supported (no function calling)")] \
        | None = None
    functions: Annotated[list[Any], _unsupported("is not supported (no function calling)")] \
        | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("dependent", "needs logprobs: true",
                                      {"param": "top_logprobs"})
        return self
