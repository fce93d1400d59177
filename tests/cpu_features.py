"""What this CPU has, for tests of kernels that need an ISA extension.

A kernel test that needs AVX512-BF16 runs where the CPU has it and is skipped elsewhere
with that reason; `test_kernels_are_available_exactly_where_the_cpu_has_the_isa`
(tests/engine/test_cpu_features.py) checks on every CPU the property that holds
everywhere: the kernel is available exactly where /proc/cpuinfo lists the flag, so a
build that silently lost the kernel fails on the machines that should have it, and a
machine without it serves through the other path.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


requires_avx512_bf16 = pytest.mark.skipif(
    not has_avx512_bf16(),
    reason="this CPU has no AVX512-BF16, so the kernel never runs here (its availability "
           "is checked by tests/engine/test_cpu_features.py)")


def has_avx512_core() -> bool:
    """AVX512 F, BW, VL and DQ: where oneDNN's bf16 brgemm micro-kernel runs (with AMX
    tiles or AVX512-BF16 dot products where present, emulated bf16 otherwise)."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()


requires_avx512_core = pytest.mark.skipif(
    not has_avx512_core(),
    reason="this CPU has no AVX512 (F/BW/VL/DQ), so the brgemm kernel never runs here (its "
           "availability is checked by tests/engine/test_cpu_features.py)")


def has_amx_bf16() -> bool:
    return {"amx_tile", "amx_bf16"} <= cpu_flags()


requires_amx_bf16 = pytest.mark.skipif(
    not has_amx_bf16(),
    reason="this CPU has no AMX-BF16, so the paged kernel's tile path never runs here (its "
           "availability is checked by tests/engine/test_cpu_features.py)")
