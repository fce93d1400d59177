"""One interface over npu | cuda | cpu: streams, events, synchronisation.

On CPU, streams and events complete at once, so the same prepare-stream/forward-stream
code runs (and is tested) everywhere. torch_npu is imported only for an NPU device.
"""

from __future__ import annotations

import contextlib

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


class Device:
    """Streams and events of one accelerator (or the CPU)."""

    def __init__(self, spec: str):
        self.torch_device = torch.device(spec)
        self.type = self.torch_device.type
        if self.type == "npu":
            import torch_npu  # noqa: F401  (registers torch.npu)
        self._mod = getattr(torch, self.type) if self.type in ("cuda", "npu") else None
        if self._mod is not None and not self._mod.is_available():
            raise RuntimeError(f"device {spec!r} requested but torch.{self.type} is not "
                               "available on this machine")

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
