"""A tensor-parallel group on torch.distributed, and what crosses it each step.

Rank 0 lives in the engine's process and owns the scheduler, the input builder and the
sampler; every rank holds its shard of the weights and of the KV cache. Each step rank 0
broadcasts the step's ForwardInput (`broadcast_step`), every rank runs the same forward,
and the row-parallel layers' partial sums meet in an all-reduce (shard.py). The backend
follows the device: gloo on CPU, nccl on CUDA, hccl on Ascend (through torch_npu).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# a rank that stops answering (killed, hung) ends the others' wait after this long
TIMEOUT = datetime.timedelta(seconds=120)
STOP = "stop"


def backend_for(device: torch.device | str) -> str:
    kind = torch.device(device).type
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(kind, "gloo")


class TpGroup:
    def __init__(self, rank: int, world_size: int, init_method: str, device: torch.device):
        self.rank, self.world_size = rank, world_size
        self.backend = backend_for(device)
        dist.init_process_group(self.backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=TIMEOUT)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (pickled: host tensors and metadata)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
