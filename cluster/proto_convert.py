"""Conversions between the wire messages (protos/) and engine objects."""

from __future__ import annotations

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


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """ValueError (naming the field) on bad values; unset fields take engine defaults."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING if msg.HasField(name)}
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    return SamplingParams(**kwargs)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(stop=list(params.stop),
                                    stop_token_ids=list(params.stop_token_ids))
    for name in _OPTIONAL_SAMPLING:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


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


def logprob_to_proto(token_id: int, entry: dict[int, float]) -> common_pb2.TokenLogprob:
    """entry: {sampled token: logprob, then the top-k alternatives (descending)}."""
    top = [common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.items()]
    return common_pb2.TokenLogprob(token_id=token_id, logprob=entry[token_id], top=top)


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> dict[int, float]:
    entry = {msg.token_id: msg.logprob}
    for t in msg.top:
        entry.setdefault(t.token_id, t.logprob)
    return entry
