"""pydantic ValidationError -> InvalidRequest whose message reads like the rest of the API
("max_tokens must be <= 2147483647, got 1099511627776") and whose `param` is the top-level
field a client can look up in the API reference (OpenAI's error body convention)."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from router.errors import InvalidRequest

_SHOWN_CHARS = 60     # of a bad value in a message: a 20 MB string is not echoed back

# pydantic error type -> predicate (the subject, the field's path, comes first).
_PREDICATES = {
    "missing": "is required",
    "bool_type": "must be a boolean",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "too_short": "must have at least {min_length} items",
    "empty_list": "must be a non-empty list",
    "too_long": "must have at most {max_length} items",
    "string_too_short": "must not be empty",
    "string_too_long": "must be at most {max_length} characters",
    "literal_error": "must be one of {expected}",
}
_NO_VALUE = {"missing", "dependent", "unsupported"}


def shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _path(loc: tuple) -> str:
    """('messages', 0, 'content') -> messages[0].content; the union branch tags ('<text>')
    are ours, not the client's, and are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith("<"):
            out += f".{part}" if out else str(part)
    return out


def to_invalid(exc: ValidationError) -> InvalidRequest:
    """The first error (the one a client fixes first), as an InvalidRequest."""
    err = exc.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    loc = tuple(err["loc"])
    where = _path(loc)
    param = str(loc[0]) if loc else None
    if "param" in ctx:                        # a rule over several fields, raised on the body
        param = where = ctx["param"]
    if "field" in ctx:                        # a rule raised on an object, about one key
        where = f"{where}.{ctx['field']}" if where else ctx["field"]
    kind = err["type"]
    if kind in ("too_short", "too_long") and isinstance(err.get("input"), str):
        kind = f"string_{kind}"               # a length rule applied after our str checks
    if kind == "too_short" and ctx.get("min_length") == 1:
        kind = "empty_list"
    template = _PREDICATES.get(kind)
    if template is not None:
        predicate = template.format(**ctx)
    else:
        predicate = err["msg"]                # our own PydanticCustomError texts
    message = f"{where} {predicate}" if where else predicate
    if kind not in _NO_VALUE and "input" in err:
        message += f", got {shown(err['input'])}"
    return InvalidRequest(message, param)


def validate(schema: type[BaseModel], data: dict) -> BaseModel:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise to_invalid(exc) from None
