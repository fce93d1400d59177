"""On every CPU kind: the kernels that need AVX512-BF16 (or AVX512 for the brgemm prefill
kernel) are available exactly where the CPU has it (a g++ that can build them is part of
`make test`'s setup), the paged decode kernel's tile path exactly where it has AMX-BF16,
and where one is missing the model's layers take the other path."""

from __future__ import annotations

import torch

from engine.layers import cpu_bf16_gemm, cpu_paged_attention, cpu_prefill_attention
from tests.cpu_features import has_amx_bf16, has_avx512_bf16, has_avx512_core


def test_kernels_are_available_exactly_where_the_cpu_has_the_isa():
    assert cpu_bf16_gemm.available() == has_avx512_bf16(), cpu_bf16_gemm.EXTENSION.failed
    assert cpu_prefill_attention.usable(torch.bfloat16, 64, 1, 16) == has_avx512_bf16(), \
        cpu_prefill_attention.EXTENSION.failed
    # oneDNN's bf16 micro-kernel runs from AVX512 up (and passed its self-test here)
    assert cpu_prefill_attention.brgemm_usable(torch.bfloat16, 64, 3) == has_avx512_core(), \
        cpu_prefill_attention.EXTENSION.failed
    # the packed copies' brgemm kernel runs wherever they exist
    assert cpu_bf16_gemm.brgemm_available() == has_avx512_bf16(), cpu_bf16_gemm.EXTENSION.failed
    # the decode kernel's tile path wherever the CPU has AMX-BF16 (and no other shape)
    assert cpu_paged_attention.amx_fits(torch.bfloat16, 64, 3, 16) == has_amx_bf16(), \
        cpu_paged_attention.EXTENSION.failed
    assert not cpu_paged_attention.amx_fits(torch.float32, 64, 3, 16)
    assert not cpu_paged_attention.amx_fits(torch.bfloat16, 128, 3, 16)
    assert not cpu_paged_attention.amx_fits(torch.bfloat16, 64, 3, 8)
