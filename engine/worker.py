"""Worker: step -> prepare_work_before_execute -> step_internal
(docs/ARCHITECTURE.md, 'The execution trunk', steps 3-6).

prepare_work_before_execute moves the whole ForwardInput to the device on the prepare
stream and records an event; step_internal makes the forward stream wait on that event,
runs the executor, computes logits on the selected rows only and samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device import Device
from engine.executor.factory import build_executor
from engine.executor.graph_buckets import GraphOptions
from engine.forward_input import ForwardInput
from engine.kv_cache import KVCache
from engine.sampler import SampleOutput, Sampler


@dataclass
class PreparedInput:
    input: ForwardInput      # device tensors
    ready_event: object      # recorded on the prepare stream


class Worker:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: Device,
                 graph: GraphOptions | None = None, before_forward=None):
        """before_forward(fi): called with each step's input before its forward (tensor
        parallel: the other ranks get it, engine/parallel/rank_worker.py)."""
        self.model = model
        self.before_forward = before_forward
        self.kv_cache = kv_cache
        self.device = device
        self.executor = build_executor(model, kv_cache, device, graph)
        self.graphs_on = graph is not None
        kernels = getattr(model, "kernels", None)
        self.sampler = Sampler(cpu_argmax=kernels is not None and kernels.cpu_fused_ops)
        self.prepare_stream = device.new_stream()

    def prepare_work_before_execute(self, fi: ForwardInput) -> PreparedInput:
        # with graphs on, no H2D copy may be queued while a capture is in progress (the
        # capture lock of docs/ARCHITECTURE.md, 'The execution trunk', step 3)
        with self.device.capture_lock.held_if(self.graphs_on), \
                self.device.stream(self.prepare_stream):
            moved = fi.to(self.device.torch_device)
            event = self.device.new_event()
            event.record(self.prepare_stream)
        return PreparedInput(moved, event)

    def step(self, fi: ForwardInput) -> SampleOutput | None:
        prepared = self.prepare_work_before_execute(fi)
        self.device.current_stream().wait_event(prepared.ready_event)
        return self.step_internal(prepared.input)

    @torch.inference_mode()
    def step_internal(self, fi: ForwardInput) -> SampleOutput | None:
        if self.before_forward is not None:
            self.before_forward(fi)
        hidden = self.executor.forward(fi)
        if fi.sampling is None or fi.selected_token_idxes.numel() == 0:
            return None     # only prefill chunks that sample nothing
        # the Sampler widens to float32 where it needs to (not for a plain greedy batch)
        logits = self.model.logits(hidden, fi.selected_token_idxes, float32=False)
        return self.sampler(logits, fi.sampling)
