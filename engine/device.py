"""One interface over npu | cuda | cpu: streams, events, synchronisation, graphs.

On CPU, streams and events complete at once, so the same prepare-stream/forward-stream
code runs (and is tested) everywhere. torch_npu is imported only for an NPU device.

Graphs: `torch.cuda.CUDAGraph` / `torch.npu.NPUGraph` captured into one shared memory
pool; on CPU a `CpuGraph` that reruns the captured callable over the same persistent
buffers, so the graph executor's binding logic is one code path on every device.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch


class _ImmediateEvent:
    """CPU stand-in: work is already done when recorded."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _ImmediateStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuGraph:
    """CPU stand-in for a device graph: "capture" records the callable (running nothing,
    like a real capture), replay reruns it. The callable reads only the persistent input
    buffers and writes the persistent output buffer, exactly as on a GPU."""

    def __init__(self):
        self._fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay of a graph that was never captured")
        self._fn()


class DeviceCaptureLock:
    """Held across prepare (H2D on the prepare stream) while graphs are on, and across
    each capture, so an asynchronous copy never lands inside a capture
    (docs/ARCHITECTURE.md, 'The execution trunk', step 3).
    A capture in "global" mode fails on any work queued from another thread."""

    def __init__(self):
        self._lock = threading.Lock()

    def __enter__(self) -> DeviceCaptureLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def held_if(self, enabled: bool):
        return self if enabled else contextlib.nullcontext()


class Device:
    """Streams, events and graphs of one accelerator (or the CPU)."""

    def __init__(self, spec: str, cpu_threads: int | None = None):
        """cpu_threads: torch's intra-op threads on a CPU device (process-wide; None keeps
        torch's default, one per core). Two engines sharing a machine's cores (a prefill
        and a decode node on one host) each spin OpenMP threads on all of them otherwise."""
        self.torch_device = torch.device(spec)
        if self.torch_device.type == "cpu":
            from engine.host_allocator import keep_large_allocations_in_heap
            keep_large_allocations_in_heap()
            if cpu_threads:
                torch.set_num_threads(cpu_threads)
        self.type = self.torch_device.type
        if self.type == "npu":
            import torch_npu  # noqa: F401  (registers torch.npu)
        self._mod = getattr(torch, self.type) if self.type in ("cuda", "npu") else None
        if self._mod is not None and not self._mod.is_available():
            raise RuntimeError(f"device {spec!r} requested but torch.{self.type} is not "
                               "available on this machine")
        self.capture_lock = DeviceCaptureLock()

    @property
    def is_cpu(self) -> bool:
        return self._mod is None

    def new_stream(self, high_priority: bool = False):
        if self._mod is None:
            return _ImmediateStream()
        return self._mod.Stream(device=self.torch_device, priority=-1 if high_priority else 0)

    def current_stream(self):
        return _ImmediateStream() if self._mod is None else self._mod.current_stream(
            self.torch_device)

    def new_event(self):
        return _ImmediateEvent() if self._mod is None else self._mod.Event()

    def stream(self, stream):
        """Context manager making `stream` current."""
        if self._mod is None:
            return contextlib.nullcontext()
        return self._mod.stream(stream)

    def synchronize(self) -> None:
        if self._mod is not None:
            self._mod.synchronize(self.torch_device)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked host memory for async H2D copies (no-op on CPU)."""
        return tensor if self._mod is None else tensor.pin_memory()

    # ---- graphs --------------------------------------------------------------------
    @property
    def capture_warmup_iters(self) -> int:
        """Eager runs before a capture, on the capture stream: lazy library handles and
        workspaces (cuBLAS, attention kernels) must exist before capture begins. None on
        CPU, where there is nothing to initialise."""
        return 0 if self._mod is None else 2

    def graph_pool_handle(self):
        """One memory pool every graph of an executor captures into."""
        return object() if self._mod is None else self._mod.graph_pool_handle()

    def capture_graph(self, fn: Callable[[], None], pool, stream):
        """Capture `fn` (which must read and write only persistent buffers) on `stream`.
        Nothing runs on CPU; on a GPU the kernels are recorded, not executed."""
        if self._mod is None:
            graph = CpuGraph()
            graph.capture(fn)
            return graph
        graph = self._mod.NPUGraph() if self.type == "npu" else self._mod.CUDAGraph()
        self.synchronize()      # nothing outstanding may leak into the capture
        with self._mod.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                fn()
            finally:
                graph.capture_end()
        return graph
