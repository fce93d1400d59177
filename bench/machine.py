"""What every result file records about the machine it came from: a figure holds for the
CPU it was made on (a kernel that won on an AVX512-BF16 EPYC lost 2x on an AMX Xeon), so
each file names the CPU model, the ISA flags that decide which kernels run, the cores and
caches, and the kernels pdserve chose by measurement there."""

from __future__ import annotations

import os
from pathlib import Path

import torch

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _caches() -> dict[str, str]:
    """{"L1d": "48K", "L2": "2048K", "L3": "491520K"} of CPU 0 (L2 is per core on most
    server CPUs, L3 shared)."""
    out = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction":
            out[f"L{level}" + ("d" if kind == "Data" else "")] = size
    return out


def model_kernels(model: str, dtype: str) -> dict[str, str]:
    """The kernels pdserve takes for `model` here (a short load: the choices are read from
    the machine's cache, or measured and kept), key -> kernel."""
    from engine import LLM
    from engine.layers.kernel_choice import CHOICES
    llm = LLM(model, dtype=dtype, num_gpu_blocks=64, max_model_len=512)
    del llm
    return CHOICES.made()


def cpu_record() -> dict:
    from engine.layers.kernel_choice import cpu_model_and_flags
    model, flags = cpu_model_and_flags()
    return {"cpu_model": model, "flags": {f: f in flags for f in FLAGS},
            "os_cpus": os.cpu_count(), "caches": _caches(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def cpu_line(rec: dict) -> str:
    if not rec:
        return "not recorded"
    flags = ", ".join(f for f, on in rec["flags"].items() if on) or "none of " + ", ".join(FLAGS)
    caches = ", ".join(f"{k} {v}" for k, v in rec["caches"].items())
    return (f"{rec['cpu_model']}; {flags}; {rec['os_cpus']} CPUs; {caches}; torch "
            f"{rec['torch']} ({rec['torch_cpu_capability']})")


def kernels_line(chosen: dict[str, str]) -> str:
    """The measured choices a model took, summarised: family and kernel -> count."""
    if not chosen:
        return "none recorded"
    counts: dict[str, int] = {}
    for key, name in chosen.items():
        family = key.split(" ", 1)[0]
        counts[f"{family}: {name}"] = counts.get(f"{family}: {name}", 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))
