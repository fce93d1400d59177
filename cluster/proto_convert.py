"""Conversions between the wire messages (protos/) and engine objects."""

from __future__ import annotations

from engine.commands import EngineOutput
from engine.logprobs import TokenLogprob
from engine.pd_fingerprint import Fingerprint
from engine.sampling_params import SamplingParams
from protos import common_pb2, node_pb2

_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                      "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "ignore_eos", "seed", "logprobs", "skip_special_tokens")

FINISH_REASONS = {None: common_pb2.FINISH_REASON_UNSPECIFIED,
                  "stop": common_pb2.FINISH_REASON_STOP,
                  "length": common_pb2.FINISH_REASON_LENGTH,
                  "abort": common_pb2.FINISH_REASON_ABORT}
FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def sampling_fields_from_proto(msg: common_pb2.SamplingParams) -> dict:
    """The fields the client set, as SamplingParams keyword arguments (a front applies
    its own defaults to the rest)."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING if msg.HasField(name)}
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    return kwargs


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """ValueError (naming the field) on bad values; unset fields take engine defaults."""
    return SamplingParams(**sampling_fields_from_proto(msg))


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(stop=list(params.stop),
                                    stop_token_ids=list(params.stop_token_ids))
    for name in _OPTIONAL_SAMPLING:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def finish_from_proto(value: int) -> str | None:
    return FINISH_NAMES.get(value)


def finish_to_proto(reason: str | None) -> int:
    return FINISH_REASONS.get(reason, common_pb2.FINISH_REASON_UNSPECIFIED) if reason else 0


def fingerprint_to_proto(fp: Fingerprint) -> node_pb2.Fingerprint:
    return node_pb2.Fingerprint(
        model=fp.model, dtype=fp.dtype, block_size=fp.block_size, kv_layout=fp.kv_layout,
        num_layers=fp.num_layers, num_kv_heads=fp.num_kv_heads, head_dim=fp.head_dim,
        mtp=node_pb2.MtpConfig(enabled=fp.mtp_enabled,
                               num_speculative_tokens=fp.mtp_num_speculative_tokens,
                               num_draft_layers=fp.mtp_num_draft_layers))


def fingerprint_from_proto(msg: node_pb2.Fingerprint) -> Fingerprint:
    return Fingerprint(model=msg.model, dtype=msg.dtype, block_size=msg.block_size,
                       kv_layout=msg.kv_layout, num_layers=msg.num_layers,
                       num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim,
                       mtp_enabled=msg.mtp.enabled,
                       mtp_num_speculative_tokens=msg.mtp.num_speculative_tokens,
                       mtp_num_draft_layers=msg.mtp.num_draft_layers)


def logprob_to_proto(entry: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=entry.token_id, logprob=entry.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top])


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob,
                        tuple((t.token_id, t.logprob) for t in msg.top))


def token_event(out: EngineOutput) -> node_pb2.TokenEvent:
    """What a request gained (an engine output) as the decode node streams it."""
    event = node_pb2.TokenEvent(token_ids=out.token_ids, text_delta=out.text)
    event.logprobs.extend(logprob_to_proto(entry) for entry in out.logprobs)
    if out.finished:
        event.finish_reason = FINISH_REASONS.get(out.finish_reason,
                                                 common_pb2.FINISH_REASON_ABORT)
        if out.stop_reason is not None:
            event.stop_reason = str(out.stop_reason)
        event.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
            cached_prompt_tokens=out.num_cached_tokens))
    return event


def logprobs_from_proto(entries) -> list[TokenLogprob]:
    return [logprob_from_proto(e) for e in entries]


def logprobs_to_proto(entries: list[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [logprob_to_proto(e) for e in entries]
