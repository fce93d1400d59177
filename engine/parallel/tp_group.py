"""A tensor-parallel group on torch.distributed, and what crosses it each step.

Rank 0 lives in the engine's process and owns the scheduler, the input builder and the
sampler; every rank holds its shard of the weights and of the KV cache. Each step rank 0
broadcasts the step's ForwardInput (`broadcast_step`), every rank runs the same forward,
and the row-parallel layers' partial sums meet in an all-reduce (shard.py). The backend
follows the device: gloo on CPU, nccl on CUDA, hccl on Ascend (through torch_npu).
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

# a rank that stops answering (killed, hung) ends the others' wait after this long
TIMEOUT = datetime.timedelta(seconds=120)
STOP = "stop"
WRITE = "write"       # (WRITE, [(layer, value, block ids, whole-head blocks)...])
GATHER = "gather"     # (GATHER, layer, block ids): every rank's heads of them, to rank 0


def backend_for(device: torch.device | str) -> str:
    kind = torch.device(device).type
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(kind, "gloo")


def store_for(init_method: str, rank: int, world_size: int):
    """The rendezvous: a file (ranks on one machine) or tcp://HOST:PORT, rank 0 listening
    on PORT of every interface and the others connecting to HOST (ranks on other hosts)."""
    if init_method.startswith("file://"):
        return dist.FileStore(init_method.removeprefix("file://"), world_size)
    if not init_method.startswith("tcp://"):
        raise ValueError(f"tensor parallel rendezvous {init_method!r}: file:// or tcp://")
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return dist.TCPStore("0.0.0.0" if rank == 0 else host.strip("[]"), int(port), world_size,
                         is_master=rank == 0, timeout=TIMEOUT, wait_for_workers=False)


class TpGroup:
    """One engine's group. On a CPU it is a gloo process group of its own over a file
    store, not torch.distributed's process-wide default group, so two tensor-parallel
    engines can live in one process (a test's prefill and decode nodes); nccl and hccl take
    the default group (one engine a process, as nodes run)."""

    def __init__(self, rank: int, world_size: int, init_method: str, device: torch.device):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.backend = backend_for(device)
        self._pg = None
        if self.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store_for(init_method, rank, world_size), rank,
                                             world_size, TIMEOUT)
        else:
            dist.init_process_group(self.backend, init_method=init_method, rank=rank,
                                    world_size=world_size, timeout=TIMEOUT)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._pg is None:
            dist.all_reduce(t)
        else:
            self._pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape on every rank), in rank order."""
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        if self._pg is None:
            dist.all_gather(out, t)
        else:
            self._pg.allgather([out], [t]).wait()
        return out

    def _broadcast(self, t: torch.Tensor) -> None:
        if self._pg is None:        # nccl / hccl move device tensors only
            on_device = t.to(self.device)
            dist.broadcast(on_device, src=0)
            t.copy_(on_device)
        else:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self._pg.broadcast([t], opts).wait()

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (pickled: host tensors and metadata; the caller
        moves device tensors to the host first, a rank's device is its own)."""
        size = torch.zeros(1, dtype=torch.int64)
        data = None
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size[0] = data.numel()
        self._broadcast(size)
        if self.rank != 0:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        self._broadcast(data)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    @property
    def is_open(self) -> bool:
        return self._pg is not None or dist.is_initialized()

    def close(self) -> None:
        if self._pg is None and dist.is_initialized():
            dist.destroy_process_group()
        self._pg = None
