"""The ranks of a tensor-parallel engine other than rank 0, each a process of its own.

`start_ranks` (in the engine's process, rank 0) spawns ranks 1..N-1 and joins the group
with them; each rank loads the model, cuts its shard (shard.py), makes its KV cache of
the block count rank 0 sends, then runs every forward rank 0 broadcasts, in lockstep (the
row-parallel all-reduces meet there), until rank 0 sends STOP. A rank that dies ends the
others' collective waits with an error after tp_group.TIMEOUT.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.layers.kernel_options import KernelOptions
from engine.parallel.shard import shard_model
from engine.parallel.tp_group import GATHER, STOP, WRITE, TpGroup
from engine.parallel.tp_kv_cache import TpKvCache

log = logging.getLogger(__name__)

HOST = torch.device("cpu")


def load_shard(config: EngineConfig, dtype: torch.dtype, device: torch.device, rank: int,
               group: TpGroup):
    """(model shard, config) of this rank: float weights, C++ kernels off (a rank's
    forward runs the Python layers, where the all-reduces sit)."""
    from engine.models.loader import load_model
    model, mcfg = load_model(config.model, dtype, device, config.attention_backend,
                             replace(KernelOptions.torch_only(),
                                     batch_invariant=config.batch_invariant))
    shard_model(model, rank, group.world_size, group,
                expert_parallel=config.expert_parallel_size > 1)
    return model, mcfg


def shard_cache(mcfg, num_blocks: int, block_size: int, dtype, device, rank: int,
                world: int, ranks=None) -> TpKvCache:
    """This rank's KV cache: its own KV heads, whole heads at its boundary."""
    heads, k_dim, v_dim = mcfg.kv_layout
    return TpKvCache(mcfg.num_hidden_layers, num_blocks, block_size, mcfg.num_attention_heads,
                     heads, k_dim, dtype, device, rank, world, ranks, v_head_dim=v_dim)


def run_rank(rank: int, config: EngineConfig) -> None:
    """`pdserve tp-rank`: rank `rank` of the group whose rank 0 listens at
    config.tensor_parallel_store, until rank 0 stops (or the group breaks)."""
    from engine.device import Device
    from engine.dtype import resolve_dtype
    from engine.models.model_config import ModelConfig
    if not 1 <= rank < config.tensor_parallel_size:
        raise ValueError(f"rank {rank} is not in 1..{config.tensor_parallel_size - 1}")
    if config.tensor_parallel_store is None:
        raise ValueError("a rank started apart needs tensor_parallel_store (HOST:PORT)")
    mcfg = ModelConfig.from_folder(config.model)
    dtype = resolve_dtype(config.dtype, mcfg.torch_dtype, Device(config.device))
    _rank_main(rank, config.tensor_parallel_size, f"tcp://{config.tensor_parallel_store}",
               config, str(dtype).removeprefix("torch."))


def _rank_main(rank: int, world: int, init_method: str, config: EngineConfig,
               dtype_name: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device(config.device)
    if device.type != "cpu" and device.index is None:   # one accelerator a rank
        device = torch.device(device.type, rank)
    group = TpGroup(rank, world, init_method, device)
    try:
        dtype = getattr(torch, dtype_name)
        model, mcfg = load_shard(config, dtype, device, rank, group)
        num_blocks = group.broadcast()
        cache = shard_cache(mcfg, num_blocks, config.block_size, dtype, device, rank, world)
        with torch.inference_mode():
            while True:
                msg = group.broadcast()
                if msg == STOP:
                    return
                if isinstance(msg, tuple) and msg[0] == WRITE:
                    cache.apply(msg[1])
                elif isinstance(msg, tuple) and msg[0] == GATHER:
                    group.all_gather(cache.local_blocks(msg[1], msg[2].to(device)))
                else:           # the forward, then the logits as rank 0's Worker takes them
                    msg = msg.to(device)
                    hidden = model(msg.token_ids, msg.positions, cache, msg.attn)
                    if msg.sampling is not None and msg.selected_token_idxes.numel():
                        model.logits(hidden, msg.selected_token_idxes)
    finally:
        group.close()


class Ranks:
    """Rank 0's handle on the group and on the other ranks' processes."""

    def __init__(self, config: EngineConfig, dtype: torch.dtype, device: torch.device):
        """With config.tensor_parallel_store the other ranks are started apart (`pdserve
        tp-rank`) and join there; else they are spawned here."""
        world = config.tensor_parallel_size
        self.dtype, self.device = dtype, device
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-tp-")
        init_method = f"file://{self._dir.name}/rendezvous"
        self.procs = []
        if config.tensor_parallel_store is not None:
            init_method = f"tcp://{config.tensor_parallel_store}"
        else:
            ctx = multiprocessing.get_context("spawn")
            dtype_name = str(dtype).removeprefix("torch.")
            self.procs = [ctx.Process(target=_rank_main, daemon=True,
                                      name=f"pdserve-tp-rank{r}",
                                      args=(r, world, init_method, config, dtype_name))
                          for r in range(1, world)]
        for p in self.procs:
            p.start()
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
        self.group = TpGroup(0, world, init_method, device)
        self._stopped = threading.Event()
        # why a rank is gone (None while every rank lives); on_lost(why) is called once
        # from the watcher thread (a node exits, so it leaves discovery and the router
        # replays its requests elsewhere)
        self.lost: str | None = None
        self.on_lost: Callable[[str], None] | None = None
        self.cache: TpKvCache | None = None         # rank 0's, once made (engine_core)
        if self.procs:      # ranks started apart: a lost one fails the next collective
            threading.Thread(target=self._watch, name="pdserve-tp-watch", daemon=True).start()
        weakref.finalize(self, Ranks._stop, self.group, self.procs, self._dir)
        log.info("tensor parallel: %d ranks on %s, ranks 1-%d %s", world, self.group.backend,
                 world - 1, f"in processes {[p.pid for p in self.procs]}" if self.procs
                 else f"joined at {init_method}")

    @classmethod
    def start(cls, config: EngineConfig, mcfg, dtype: torch.dtype, device: torch.device):
        """(ranks, rank 0's model shard, its config): the model checked first (a clear
        error before any rank starts), then the ranks, then rank 0's own shard."""
        from engine.parallel.shard import check_shardable
        check_shardable(mcfg, config.tensor_parallel_size, config.expert_parallel_size)
        ranks = cls(config, dtype, device)
        model, mcfg = load_shard(config, dtype, device, 0, ranks.group)
        return ranks, model, mcfg

    def make_cache(self, mcfg, num_blocks: int, block_size: int) -> TpKvCache:
        """Rank 0's KV cache; the other ranks make theirs of the block count sent here."""
        self.group.broadcast(num_blocks)
        self.cache = shard_cache(mcfg, num_blocks, block_size, self.dtype, self.device, 0,
                                 self.group.world_size, self)
        return self.cache

    def _watch(self) -> None:
        """Wait on the ranks' process sentinels: one that ends before close() is a lost
        rank, and the group cannot compute without it."""
        ended = multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self._stopped.is_set():
            return
        dead = [p for p in self.procs if p.sentinel in ended]
        self.lost = (f"tensor-parallel rank {dead[0].name} exited (code "
                     f"{dead[0].exitcode}); the group cannot go on")
        log.error("%s", self.lost)
        if self.on_lost is not None:
            self.on_lost(self.lost)

    def send_step(self, fi) -> None:
        """Before each forward of rank 0: the KV blocks that landed since the last one (a
        decode node's pushes), then the forward; every rank runs the same one."""
        self._check()
        if self.cache is not None:
            writes = self.cache.take_pending()
            if writes:
                self.group.broadcast((WRITE, writes))
        self.group.broadcast(fi.to(HOST))      # each rank moves it to its own device

    def gather_kv(self, cache: TpKvCache, layer: int, block_ids: torch.Tensor
                  ) -> torch.Tensor:
        """Every rank's heads of one layer's blocks (a prefill node's push; between
        forwards, on the engine thread): [2, n, block_size, all KV heads, head_dim]."""
        self._check()
        self.group.broadcast((GATHER, layer, block_ids.to(HOST)))
        return cache.assemble(self.group.all_gather(cache.local_blocks(layer, block_ids)))

    def _check(self) -> None:
        if self.lost is not None:
            raise RuntimeError(self.lost)

    def close(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            Ranks._stop(self.group, self.procs, self._dir)

    @staticmethod
    def _stop(group: TpGroup, procs, tmp) -> None:
        try:
            if group.is_open and all(p.is_alive() for p in procs):
                group.broadcast(STOP)
        except Exception as exc:  # noqa: BLE001 - stopping: a dead rank is already gone
            log.warning("tensor parallel: stopping the ranks: %s", exc)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        group.close()
        tmp.cleanup()
