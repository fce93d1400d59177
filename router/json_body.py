"""Decoding an HTTP request body into JSON at the edge: limits on nesting depth and on the
number of values, checked before the parser runs, and every failure an InvalidRequest
(never a 500).

Why: Python's json parser recurses per nesting level, so `[[[[...]]]]` a few thousand deep
raises RecursionError (a 500) after burning the stack, and it holds the GIL for the whole
parse, so ten million small values would stall the event loop even from a worker thread.
Nothing a client legitimately sends nests deeper than a few levels
(messages[i].content[j]) or needs more values than a long token-id prompt.

The scan runs at C speed over the raw bytes (bytes.replace / split / translate / count,
numpy for the running depth over at most 2 * MAX_JSON_ITEMS brackets); it may misjudge a
body that is not valid JSON, which the parser then refuses anyway.
"""

from __future__ import annotations

import json

import numpy as np

from router.errors import InvalidRequest

MAX_JSON_DEPTH = 32
MAX_JSON_ITEMS = 1_000_000         # array elements + object members (commas + 1)
_KEEP = b"[]{},"
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _KEEP)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def _too_many(what: str) -> InvalidRequest:
    return InvalidRequest(f"the request body has more than {MAX_JSON_ITEMS} {what}")


def check_structure(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """InvalidRequest if `raw` nests deeper than max_depth or holds too many values."""
    # Escapes first: an escaped quote must not end a string. Inside a JSON string every
    # backslash starts a two-character escape, so dropping `\\` pairs and then `\"` pairs
    # (both left to right) pairs them exactly as a parser does.
    s = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    if s.count(b'"') > 2 * MAX_JSON_ITEMS:          # two per string, keys included
        raise _too_many("strings")
    s = b"".join(s.split(b'"')[0::2]).translate(None, _NOT_STRUCTURE)   # outside strings
    if s.count(b",") >= MAX_JSON_ITEMS:
        raise _too_many("values")
    brackets = s.translate(None, b",")
    if len(brackets) > 2 * MAX_JSON_ITEMS:
        raise _too_many("arrays and objects")
    if not brackets:
        return
    depth = int(np.cumsum(_STEP[np.frombuffer(brackets, dtype=np.uint8)], dtype=np.int64).max())
    if depth > max_depth:
        raise InvalidRequest(f"the request body nests {depth} levels deep; at most "
                             f"{max_depth} are accepted")


def _no_constant(name: str):
    # Python's json accepts NaN / Infinity; JSON does not, and no API field may hold them.
    raise InvalidRequest(f"the request body is not valid JSON: {name} is not a JSON value")


def decode_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> object:
    check_structure(raw, max_depth)
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:                    # a depth the scan missed (malformed strings)
        raise InvalidRequest("the request body nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        # JSONDecodeError, bad encodings, and integers over Python's digit limit (4300)
        raise InvalidRequest(f"the request body is not valid JSON: {str(exc)[:200]}") from None
