"""engine.pd_mtp.MtpHandoff <-> PushDone.mtp (node.proto MtpPayload): the last target
hidden state and the draft layer's K/V for the pushed blocks, as raw bytes."""

from __future__ import annotations

import math

import torch

from cluster.kv_transfer.codec import tensor_bytes, tensor_from_bytes
from cluster.kv_transfer.kv_receiver import PushRejected
from engine.pd_mtp import MtpHandoff
from protos import node_pb2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def handoff_to_proto(handoff: MtpHandoff, dst_block_ids: list[int]) -> node_pb2.MtpPayload:
    """dst_block_ids: the decode-side ids of the pushed blocks (the header's block_ids)."""
    msg = node_pb2.MtpPayload(last_hidden_state=tensor_bytes(handoff.hidden),
                              hidden_shape=list(handoff.hidden.shape),
                              dtype=dtype_name(handoff.hidden.dtype))
    for kind, t in ((node_pb2.KV_KIND_KEY, handoff.draft_k),
                    (node_pb2.KV_KIND_VALUE, handoff.draft_v)):
        msg.draft_kv.append(node_pb2.KvChunk(layer=0, kind=kind, block_ids=dst_block_ids,
                                             shape=list(t.shape), dtype=dtype_name(t.dtype),
                                             data=tensor_bytes(t)))
    return msg


def _tensor(data: bytes, dtype: str, shape: list[int], what: str) -> torch.Tensor:
    if dtype not in DTYPES:
        raise PushRejected(f"MTP {what}: unknown dtype {dtype!r}")
    t = DTYPES[dtype]
    nbytes = math.prod(shape) * torch.empty((), dtype=t).element_size()
    if len(data) != nbytes:
        raise PushRejected(f"MTP {what}: {len(data)} bytes for shape {shape} {dtype}, "
                           f"expected {nbytes}")
    if nbytes == 0:     # no pushed blocks (frombuffer refuses an empty buffer)
        return torch.empty(shape, dtype=t)
    return tensor_from_bytes(data, t, shape)


def handoff_from_proto(msg: node_pb2.MtpPayload, push_block_ids: list[int]) -> MtpHandoff:
    """PushRejected when the payload is malformed or names other blocks than the push."""
    hidden = _tensor(msg.last_hidden_state, msg.dtype, list(msg.hidden_shape), "hidden state")
    kinds = {c.kind: c for c in msg.draft_kv}
    if len(msg.draft_kv) != 2 or set(kinds) != {node_pb2.KV_KIND_KEY, node_pb2.KV_KIND_VALUE}:
        raise PushRejected("MTP payload must carry one draft K and one draft V chunk")
    kv = []
    for kind, name in ((node_pb2.KV_KIND_KEY, "draft K"), (node_pb2.KV_KIND_VALUE, "draft V")):
        c = kinds[kind]
        if list(c.block_ids) != list(push_block_ids):
            raise PushRejected(f"MTP {name} names blocks {list(c.block_ids)}, the push "
                               f"fills {list(push_block_ids)}")
        kv.append(_tensor(c.data, c.dtype, list(c.shape), name))
    return MtpHandoff(hidden, kv[0], kv[1])
