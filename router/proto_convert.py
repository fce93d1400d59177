"""Conversions between the engine's SamplingParams / logprobs and their protobuf forms."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from protos import common_pb2

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort"}
_FINISH_PB = {v: k for k, v in _FINISH.items()}

_SCALARS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "ignore_eos", "seed",
            "skip_special_tokens")


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(stop=list(p.stop), stop_token_ids=list(p.stop_token_ids))
    for name in _SCALARS:
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> dict:
    """The fields the client set (unset optional fields take the engine's defaults)."""
    out = {name: getattr(msg, name) for name in _SCALARS + ("logprobs",) if msg.HasField(name)}
    if msg.stop:
        out["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        out["stop_token_ids"] = list(msg.stop_token_ids)
    return out


def finish_from_proto(value: int) -> str | None:
    return _FINISH.get(value)


def finish_to_proto(reason: str | None) -> int:
    return _FINISH_PB.get(reason, common_pb2.FINISH_REASON_UNSPECIFIED) if reason else 0


def logprobs_from_proto(entries) -> list[list[tuple[int, float]]]:
    return [[(e.token_id, e.logprob)] + [(t.token_id, t.logprob) for t in e.top]
            for e in entries]


def logprobs_to_proto(entries) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(
        token_id=e[0][0], logprob=e[0][1],
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in e[1:]])
        for e in entries]
