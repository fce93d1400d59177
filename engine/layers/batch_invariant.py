"""Batch-invariant mode's linears (EngineConfig.batch_invariant): a row's result must be
the same bits alone and beside any other rows, on every CPU.

The mode computes every row's attention one row at a time (engine/layers/sdpa_attention.py);
the linears are left. Under F.linear, oneDNN and MKL pick kernels and K blockings by the
row count: a gemv for one row, edge tiles past the last full micro-tile, AMX tiles on a
Xeon. So each Linear gets one of these kernels, chosen at load on the model's own weights:

- `bf16_gemm`: the weight-streaming GEMM (engine/layers/cpu_bf16_gemm.py): each row's
  sums run over k-pairs in order, whatever rows share the call. Needs AVX512-BF16 and a
  weight it packs (N a multiple of 32, K even).
- `fixed_order`: engine/layers/cpu_fixed_order_linear.py, float32 sums over k in order on
  any CPU (float32 or bf16), invariant by construction; the fallback.
- `padded`: F.linear over the rows padded to a row multiple, measured here: the smallest
  multiple that gives every probe row the same bits wherever it sits (on an AVX2 CPU
  float32 needs 4; on an AVX512-BF16 EPYC oneDNN's bf16 needs 2; on an AMX Xeon bf16 has
  none). Uses the library's own kernel, so float32 keeps HF's rounding where it holds.

Every candidate that runs here is checked by the same probe (rows alone against the same
rows in calls of many sizes at many offsets, bit for bit); among those that pass, the
fastest on the weight (timed over a decode-sized and a prefill-sized call) is taken, once
a machine: the choice is kept (engine/layers/kernel_choice.py) so every process, every
node and every later start takes the same kernel, and logged.
PDSERVE_BATCH_INVARIANT_LINEAR=<name> (KernelOptions) forces one candidate; a forced
candidate that cannot run or does not hold here is a clear error, as is a CPU where none
holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine.layers import cpu_bf16_gemm, cpu_extension, cpu_fixed_order_linear, kernel_choice
from engine.layers.linear import Linear, padded_linear

log = logging.getLogger(__name__)

CANDIDATES = ("bf16_gemm", "fixed_order", "padded")
AUTO = "auto"
# rows in a probe call, across the sizes where BLAS kernels switch (gemv, edge tiles,
# full micro-tiles)
SIZES = (*range(1, 18), 24, 31, 33, 64, 100)
ROW_MULTIPLES = (1, 2, 4, 8, 16, 32)
TIMED_ROWS = (8, 128)       # a decode batch and a prefill chunk


class NotBatchInvariant(RuntimeError):
    pass


Kernel = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]   # (x [M, K], bias)


def enable(model: torch.nn.Module, choice: str = AUTO) -> dict[tuple, str]:
    """Give every Linear of `model` a batch-invariant kernel (`choice`: auto or one of
    CANDIDATES). Returns {(shape, dtype): the kernel's name}."""
    if choice != AUTO and choice not in CANDIDATES:
        raise ValueError(f"batch-invariant linear kernel must be {AUTO} or one of "
                         f"{', '.join(CANDIDATES)}, got {choice!r}")
    gen = torch.Generator().manual_seed(0)
    chosen: dict[tuple, tuple[str, Callable[[torch.Tensor], Kernel]]] = {}
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        key = (tuple(m.weight.shape), m.weight.dtype)
        if key not in chosen:
            chosen[key] = select(m.weight, gen, choice)
        name, make = chosen[key]
        m.invariant = make(m.weight)
        m.invariant_name = name
    for (shape, dtype), (name, _) in chosen.items():
        log.info("batch-invariant linear %s %s: %s", list(shape), dtype, name)
    return {k: v[0] for k, v in chosen.items()}


def select(weight: torch.Tensor, gen: torch.Generator, choice: str = AUTO
           ) -> tuple[str, Callable[[torch.Tensor], Kernel]]:
    """(name, factory of the kernel for a weight of this shape): the forced `choice`, or
    the fastest candidate that holds on this CPU. The automatic choice is measured once a
    machine and kept (engine/layers/kernel_choice.py): every process must take the same
    kernel, or two engines' bf16 tokens could differ by which one was faster at start."""
    if choice != AUTO:
        return _measure(weight, gen, (choice,))
    key = (f"batch_invariant_linear {list(weight.shape)} {weight.dtype} "
           f"{cpu_extension.KERNELS.build_name()}")
    if key in _PICKED:          # probed already in this process (another engine's load)
        return _PICKED[key]
    found: dict[str, tuple[str, Callable]] = {}

    def measure() -> str:
        found["pick"] = _measure(weight, gen, CANDIDATES)
        return found["pick"][0]

    def still_valid(name: str) -> bool:
        return name in CANDIDATES and _pick(name, weight, gen, found)

    name = kernel_choice.CHOICES.choose(key, measure, still_valid)
    if "pick" not in found or found["pick"][0] != name:
        if not _pick(name, weight, gen, found):      # kept in this process, then broken
            raise NotBatchInvariant(f"batch_invariant: the kept choice {name} no longer "
                                    f"holds for weight {list(weight.shape)}")
    _PICKED[key] = found["pick"]
    return found["pick"]


# key -> (name, factory) of the automatic choices this process has probed
_PICKED: dict[str, tuple[str, Callable]] = {}


def _pick(name: str, weight: torch.Tensor, gen: torch.Generator, found: dict) -> bool:
    """Whether candidate `name` runs and holds here; if so it is found["pick"]."""
    make, _ = _runnable(name, weight)
    if make is not None:
        make, _ = _holding(name, make, weight, gen)
    if make is None:
        return False
    found["pick"] = (name, make)
    return True


def _measure(weight: torch.Tensor, gen: torch.Generator, names: tuple[str, ...]
             ) -> tuple[str, Callable[[torch.Tensor], Kernel]]:
    """Time the candidates that run here, probe them fastest first; the first that holds."""
    runnable, why = {}, {}
    for name in names:
        make, reason = _runnable(name, weight)
        if make is None:
            why[name] = reason
        else:
            runnable[name] = make
    times = ({name: _time(make(weight), weight, gen) for name, make in runnable.items()}
             if len(runnable) > 1 else {name: 0.0 for name in runnable})
    for name in sorted(times, key=times.__getitem__):
        make, reason = _holding(name, runnable[name], weight, gen)
        if make is not None:
            log.debug("batch-invariant linear %s: %s (timed %s)", list(weight.shape), name,
                      ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items()))
            return name, make
        why[name] = reason
    detail = "; ".join(f"{n}: {r}" for n, r in why.items())
    raise NotBatchInvariant(
        f"batch_invariant: no linear kernel gives a row the same bits whatever rows share "
        f"the call for weight {list(weight.shape)} {weight.dtype} on this CPU ({detail}); "
        f"run without batch_invariant")


def _runnable(name: str, weight: torch.Tensor):
    """(factory, None) when kernel `name` runs here on `weight`, else (None, why)."""
    if name == "bf16_gemm":
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            return None, "bf16 on CPU only"
        if not cpu_bf16_gemm.packable(weight):
            return None, "shape not packable (N a multiple of 32, K even)"
        if not cpu_bf16_gemm.available():
            return None, "needs AVX512-BF16 and its built kernel"
        return _bf16_gemm, None
    if name == "fixed_order":
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return None, "float32 or bf16 on CPU only"
        if not cpu_fixed_order_linear.available():
            return None, f"kernel not built ({cpu_fixed_order_linear.EXTENSION.failed})"
        return _fixed_order, None
    return (lambda w: _padded(w, 1)), None


def _holding(name: str, make, weight: torch.Tensor, gen: torch.Generator):
    """(factory, None) when kernel `name` passes the probe on `weight`, else (None, why);
    `padded` gets the smallest row multiple that passes."""
    if name == "padded":
        multiple = measure_row_multiple(weight, gen)
        if multiple is None:
            return None, (f"the library's kernel gives a row different bits beside other "
                          f"rows whatever row multiple up to {ROW_MULTIPLES[-1]} it is "
                          f"padded to")
        return (lambda w: _padded(w, multiple)), None
    if not holds(make(weight), weight, gen):      # a bug, never a property of the CPU
        return None, "failed the bit-for-bit probe"
    return make, None


def _bf16_gemm(weight: torch.Tensor) -> Kernel:
    packed = cpu_bf16_gemm.pack(weight.detach())

    def run(x, bias):
        if not cpu_bf16_gemm.serves(x, packed):
            x = x.contiguous()
        return cpu_bf16_gemm.gemm(x, packed, bias)
    return run


def _fixed_order(weight: torch.Tensor) -> Kernel:
    wt = cpu_fixed_order_linear.prepare(weight)
    return lambda x, bias: cpu_fixed_order_linear.linear(x, wt, bias)


def _padded(weight: torch.Tensor, multiple: int) -> Kernel:
    w = weight.detach()
    return lambda x, bias: padded_linear(x, w, bias, multiple)


def _pool(weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(SIZES[-1] * 2, weight.shape[1], generator=gen).to(weight.device,
                                                                         weight.dtype)


@torch.inference_mode()
def holds(kernel: Kernel, weight: torch.Tensor, gen: torch.Generator) -> bool:
    """Every row of every probe call equals the same row computed alone. A different
    summation order shows in a bf16 output only when it moves the rounding (a few rows in
    a hundred), so every row is checked, not one per call. Rows alone are computed as
    they are needed, so a kernel that fails is found out within a few calls."""
    pool = _pool(weight, gen)
    alone: dict[int, torch.Tensor] = {}

    def rows_alone(o: int, n: int) -> torch.Tensor:
        for i in range(o, o + n):
            if i not in alone:
                alone[i] = kernel(pool[i:i + 1], None)[0]
        return torch.stack([alone[i] for i in range(o, o + n)])
    # each size starts at its own offset, so a pool row sits at many positions
    return all(torch.equal(kernel(pool[o:o + n], None), rows_alone(o, n))
               for n in SIZES for o in (n % SIZES[-1], SIZES[-1] - n))


@torch.inference_mode()
def measure_row_multiple(weight: torch.Tensor, gen: torch.Generator) -> int | None:
    """The smallest row multiple that makes F.linear hold (`holds`), or None."""
    w = weight.detach()
    for multiple in ROW_MULTIPLES:
        if holds(lambda x, bias, m=multiple: padded_linear(x, w, bias, m), weight, gen):
            return multiple
    return None


@torch.inference_mode()
def _time(kernel: Kernel, weight: torch.Tensor, gen: torch.Generator) -> float:
    """Seconds for one call of each TIMED_ROWS size (best of 3, after a warm-up)."""
    total = 0.0
    for rows in TIMED_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
        kernel(x, None)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            kernel(x, None)
            best = min(best, time.perf_counter() - t0)
        total += best
    return total

