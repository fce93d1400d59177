"""OpenAI response bodies (completions and chat, whole and streamed) and SSE framing."""

from __future__ import annotations

import json
import time

from engine.tokenizer import Tokenizer
from router.output_stream import Delta, RequestResult
from router.requests import ParsedRequest

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict) -> bytes:
    """One server-sent event carrying a JSON object (no newlines inside: compact JSON)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"),
                                  ensure_ascii=False).encode() + b"\n\n"


def _object(req: ParsedRequest, chunk: bool) -> tuple[str, str]:
    if req.kind == "chat":
        return f"chatcmpl-{req.request_id}", ("chat.completion.chunk" if chunk
                                              else "chat.completion")
    return f"cmpl-{req.request_id}", "text_completion"


def _head(req: ParsedRequest, created: int, chunk: bool) -> dict:
    rid, obj = _object(req, chunk)
    return {"id": rid, "object": obj, "created": created, "model": req.model}


def usage(results: list[RequestResult], n: int = 1) -> dict:
    """Prompt tokens count once per prompt (its n choices share it), as OpenAI's do."""
    prompt = sum(r.num_prompt_tokens for r in results[::n])
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens
                                                           for r in results[::n])}}


def _token_str(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tok: Tokenizer, entries, text_offset: int = 0) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        s = _token_str(tok, entry.token_id)
        tokens.append(s)
        token_lps.append(entry.logprob)
        tops.append({_token_str(tok, t): v for t, v in entry.top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tok: Tokenizer, entries) -> dict:
    content = []
    for entry in entries:
        s = _token_str(tok, entry.token_id)
        content.append({"token": s, "logprob": entry.logprob, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": _token_str(tok, t), "logprob": v,
                                          "bytes": list(_token_str(tok, t).encode())}
                                         for t, v in entry.top]})
    return {"content": content}


def _finish(reason: str | None) -> str | None:
    # The engine's "abort" never reaches a client as a normal end (it is an error).
    return reason if reason in (None, "stop", "length") else "stop"


def full_response(req: ParsedRequest, results: list[RequestResult], tok: Tokenizer) -> dict:
    body = _head(req, int(time.time()), chunk=False)
    choices = []
    for i, r in enumerate(results):
        if req.kind == "chat":
            choice = {"index": i, "message": {"role": "assistant", "content": r.text},
                      "logprobs": chat_logprobs(tok, r.logprobs) if r.logprobs is not None
                      else None,
                      "finish_reason": _finish(r.finish_reason)}
        else:
            prefix = (req.prompt_texts[i] or "") if req.echo else ""
            choice = {"index": i, "text": prefix + r.text,
                      "logprobs": completion_logprobs(tok, r.logprobs)
                      if r.logprobs is not None else None,
                      "finish_reason": _finish(r.finish_reason),
                      "stop_reason": r.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = r.token_ids
        choices.append(choice)
    body["choices"] = choices
    if req.return_token_ids:
        body["prompt_token_ids"] = req.prompts if len(req.prompts) > 1 else req.prompts[0]
    body["usage"] = usage(results, req.n)
    return body


class ChunkWriter:
    """Builds the streamed chunks of one request (all choices share id and created)."""

    def __init__(self, req: ParsedRequest, tok: Tokenizer):
        self.req, self.tok = req, tok
        self.created = int(time.time())
        self._offsets = [0] * len(req.prompts)

    def _chunk(self, choice: dict) -> bytes:
        body = _head(self.req, self.created, chunk=True)
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None
        return sse_event(body)

    def start(self, index: int) -> bytes | None:
        """The first event of a choice: the chat role, or the echoed prompt."""
        if self.req.kind == "chat":
            return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None})
        if self.req.echo and self.req.prompt_texts[index]:
            return self._chunk({"index": index, "text": self.req.prompt_texts[index],
                                "logprobs": None, "finish_reason": None})
        return None

    def delta(self, index: int, d: Delta) -> bytes | None:
        if (not d.text and d.finish_reason is None and d.logprobs is None
                and not (self.req.return_token_ids and d.token_ids)):
            return None
        if self.req.kind == "chat":
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            choice = {"index": index, "delta": delta,
                      "logprobs": chat_logprobs(self.tok, d.logprobs) if d.logprobs else None,
                      "finish_reason": _finish(d.finish_reason)}
        else:
            lp = None
            if d.logprobs:
                lp = completion_logprobs(self.tok, d.logprobs, self._offsets[index])
                self._offsets[index] += sum(len(t) for t in lp["tokens"])
            choice = {"index": index, "text": d.text, "logprobs": lp,
                      "finish_reason": _finish(d.finish_reason)}
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
        if self.req.return_token_ids:
            choice["token_ids"] = d.token_ids
        return self._chunk(choice)

    def usage_chunk(self, results: list[RequestResult]) -> bytes:
        body = _head(self.req, self.created, chunk=True)
        body["choices"] = []
        body["usage"] = usage(results, self.req.n)
        return sse_event(body)


def error_event(err_body: dict) -> bytes:
    return sse_event(err_body)
