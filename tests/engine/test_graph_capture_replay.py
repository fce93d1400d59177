"""Graph replay with a GPU graph's semantics, on CPU: the decode graph must hold
everything the forward computes, not only what its Python ran at capture.

The CPU stand-in graph (engine/device.py CpuGraph) reruns the captured Python at every
replay, so a forward that skips work at capture because of host-side state (a cache
filled by the warm-up runs, say) still gives the right answer there, and only a real
CUDA graph replays the stale result. `RecordingGraph` models the real thing: capture
records the aten ops the callable dispatches (with the very tensors they read and
wrote), and replay re-executes those ops alone, writing each result into the tensor the
capture produced, without running any Python. With the device's two warm-up runs before
each capture (as on CUDA), the graph executor's hidden states must equal the eager
forward's on every decode step, for batches replayed in a padded bucket too.

This caught the rotary's cos/sin lookup cache (engine/layers/rotary.py): kept across
forwards, the capture hit the warm-up runs' entry, so the graph never gathered cos/sin
and every replay rotated by the capture's positions (on an H200: fp32 graph tokens equal
to eager on 17 of 40 prompts, bf16 on none).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.config import EngineConfig
from engine.device import Device
from engine.engine_core import LLMEngine
from engine.executor.graph import GraphExecutor
from engine.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, random_prompts


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class RecordingGraph:
    """Capture: the aten ops `fn` runs. Replay: those ops again over the same tensors,
    each result copied into the capture's output tensor (views and in-place ops land in
    the same memory already). No Python of `fn` reruns, as in a CUDA graph."""

    def __init__(self, fn):
        with _Recorder() as rec:
            fn()
        self.ops = rec.ops

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for o, n in zip(tree_leaves(out), tree_leaves(new), strict=True):
                if isinstance(o, torch.Tensor) and o.data_ptr() != n.data_ptr():
                    o.copy_(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(name, root)[0]
            for name in ("llama-untied-hd32-llama3rope", "qwen3-qknorm-hd24")}


@pytest.fixture
def gpu_like(monkeypatch):
    """The GPU's code path on CPU: torch ops only (no C++ kernels), two warm-up runs before
    each capture, and captures recorded at the aten level."""
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION_KERNEL", "0")
    monkeypatch.setenv("PDSERVE_CPU_FUSED_OPS", "0")
    monkeypatch.setattr(Device, "capture_warmup_iters", 2)
    monkeypatch.setattr(Device, "capture_graph",
                        lambda self, fn, pool, stream: RecordingGraph(fn))


def _decode_steps(engine: LLMEngine, n: int, steps: int, seed: int):
    """Greedy decode of `n` random prompts, yielding (eager hidden, graph hidden) of each
    decode step over the same cache state; the graph's result is applied."""
    ex: GraphExecutor = engine.worker.executor
    sp = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(n, [5, 17, 33, 9], engine.vocab_size, seed=seed)):
        engine.add_request(f"s{seed}-{i}", p, sp)
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        fi = engine.builder.build_forward_input(sched)
        dev = engine.worker.prepare_work_before_execute(fi).input
        if fi.attn.is_decode_only:
            eager = ex.eager.forward(dev).clone()
            hidden = ex.forward(dev)
            yield eager, hidden.clone()
        else:
            hidden = ex.forward(dev)
        tokens = engine.model.logits(hidden, fi.selected_token_idxes).argmax(-1).tolist()
        engine.scheduler.postprocess(sched, dict(zip(fi.selected_seq_ids, tokens,
                                                     strict=True)), engine.eos_token_ids)


@pytest.mark.parametrize("name", ["llama-untied-hd32-llama3rope", "qwen3-qknorm-hd24"])
def test_recorded_graph_replay_equals_eager(models, gpu_like, name):
    engine = LLMEngine(EngineConfig(model=str(models[name]), dtype="float32",
                                    enable_graph=True, max_num_seqs=8, num_gpu_blocks=64))
    ex: GraphExecutor = engine.worker.executor
    checked = 0
    for n in (1, 3):                # bucket 1 exactly, then 3 sequences in bucket 4
        for step, (eager, graph) in enumerate(_decode_steps(engine, n, steps=4, seed=n)):
            torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5,
                                       msg=f"batch {n}, decode step {step}")
            checked += 1
    assert checked == 8 and ex.graph_stats.captures == 2 and ex.graph_stats.replays == 6
