"""Which CPU kernels the model's layers use: one frozen value, chosen when the model is built.

The loader (engine/models/loader.py `load_model`) reads the user's switches once, with
`KernelOptions.from_env()`, narrows them to the model's device (`for_device`) and hands
the value to the model, which passes it to every layer at construction: the rotary
(fused rope in place in the qkv output), the norm (fused residual add + RMSNorm) and the
attention backend (the C++ paged decode kernel, the fused K/V write, the grouped decode
matmuls). Each layer settles its choice then (the option on and the kernel built); a
call checks only its input's device and dtype. Nothing in the forward path reads the
environment or a global switch, so two models in one process (a test's reference and
the engine's) can run different kernels.

Environment switches (read only by `from_env`):
    PDSERVE_CPU_ATTENTION_KERNEL=0   decode attention without the C++ paged kernel
    PDSERVE_CPU_FUSED_OPS=0          rotary, K/V writes and add+RMSNorm as torch ops
    PDSERVE_CPU_PACKED_LINEAR=0      bf16 linear layers through F.linear, not prepacked
    PDSERVE_CPU_EPILOGUE_SILU_MUL=0  the MLP's silu(gate) * up as torch ops, not in the
                                     prepacked GEMMs' epilogues
    PDSERVE_CPU_DECODE_LAYERS=0      decode steps through the Python layers, not one C++
                                     call over all of them
    PDSERVE_CPU_PREFILL_TILES=0      bf16 prefill rows through the decode kernel one row at
                                     a time, not the tile or brgemm prefill kernels
    PDSERVE_CPU_PREFILL_ATTENTION=   bf16 prefill attention: measure (default: the fastest
        measure|tiles|brgemm|rows|sdpa of the paths below that run here, timed once a
                                     machine when the KV cache is made: engine/layers/
                                     attention_choice.py), or force the tile kernel, the
                                     brgemm kernel (AMX where present), the decode kernel
                                     row by row, or torch's SDPA
    PDSERVE_CPU_DECODE_ATTENTION=    the paged decode kernel's path: measure (default: the
        measure|vector|amx           faster of the two that run here, timed once a machine
                                     when the KV cache is made: engine/layers/
                                     decode_attention_choice.py), or force its vector path
                                     or its AMX-scored one
    PDSERVE_CPU_BF16_GEMM=0          bf16 linears through oneDNN, not the weight-streaming
                                     GEMM of engine/layers/cpu_bf16_gemm.py (default: each
                                     shape and row bucket takes the fastest of oneDNN and
                                     the streaming copy's two kernels, measured at load:
                                     engine/layers/linear_choice.py; =always: the copy's
                                     VDPBF16PS kernel wherever it fits; =brgemm: its brgemm
                                     kernel wherever it fits)
    PDSERVE_BATCH_INVARIANT_LINEAR=  in batch-invariant mode, force one linear kernel
        bf16_gemm|fixed_order|padded (engine/layers/batch_invariant.py); default auto: the
                                     fastest that holds on this CPU
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

ATTENTION_KERNEL_ENV = "PDSERVE_CPU_ATTENTION_KERNEL"
FUSED_OPS_ENV = "PDSERVE_CPU_FUSED_OPS"
PACKED_LINEAR_ENV = "PDSERVE_CPU_PACKED_LINEAR"
EPILOGUE_SILU_MUL_ENV = "PDSERVE_CPU_EPILOGUE_SILU_MUL"
DECODE_LAYERS_ENV = "PDSERVE_CPU_DECODE_LAYERS"
PREFILL_TILES_ENV = "PDSERVE_CPU_PREFILL_TILES"
BF16_GEMM_ENV = "PDSERVE_CPU_BF16_GEMM"
PREFILL_ATTENTION_ENV = "PDSERVE_CPU_PREFILL_ATTENTION"
PREFILL_ATTENTION_PATHS = ("tiles", "brgemm", "rows", "sdpa")
DECODE_ATTENTION_ENV = "PDSERVE_CPU_DECODE_ATTENTION"
DECODE_ATTENTION_PATHS = ("vector", "amx")
BATCH_INVARIANT_LINEAR_ENV = "PDSERVE_BATCH_INVARIANT_LINEAR"
MLA_ABSORBED_DECODE_ENV = "PDSERVE_MLA_ABSORBED_DECODE"


@dataclass(frozen=True)
class KernelOptions:
    # decode rows on CPU through the C++ paged kernel (engine/layers/cpu_paged_attention.py)
    cpu_attention_kernel: bool = True
    # rotary, K/V writes and add+RMSNorm through engine/layers/cpu_fused_ops.py on CPU
    cpu_fused_ops: bool = True
    # torch decode path on CPU: two grouped matmuls (off: the SDPA kernel, as on GPUs)
    cpu_grouped_decode: bool = True
    # bf16 Linear weights prepacked for oneDNN at load (engine/layers/linear.py)
    cpu_packed_linear: bool = True
    # with packed linears, the MLP's silu(gate) * up in the GEMMs' epilogues from 16 rows
    # (engine/layers/linear.py silu_mul_packed)
    cpu_epilogue_silu_mul: bool = True
    # decode-only forwards run every decoder layer in one C++ call when the pieces above
    # are all on (engine/layers/cpu_decode_layers.py): the same kernels, no Python between
    cpu_decode_layers: bool = True
    # bf16 prefill rows (head_dim 64) through the tiled AVX512-BF16 prefill kernel
    # (engine/layers/cpu_prefill_attention.py) rather than one row at a time
    cpu_prefill_tiles: bool = True
    # bf16 prefill attention on CPU: "measure" (the fastest that runs, per shape and
    # machine) or one of PREFILL_ATTENTION_PATHS forced
    cpu_prefill_attention: str = "measure"
    # the paged decode kernel's path on CPU: "measure" or one of DECODE_ATTENTION_PATHS
    cpu_decode_attention: str = "measure"
    # packed bf16 linears through the weight-streaming GEMM of
    # engine/layers/cpu_bf16_gemm.py (AVX512-BF16), which keeps its own packed copy
    cpu_bf16_gemm: bool = True
    # keep its copies only where measured faster than oneDNN (off: wherever it fits, on
    # cpu_bf16_gemm_kernel, one of cpu_bf16_gemm.KERNELS)
    cpu_bf16_gemm_measure: bool = True
    cpu_bf16_gemm_kernel: str = "bf16_gemm"
    # batch-invariant mode (EngineConfig.batch_invariant): every query row's attention,
    # prefill rows included, through the C++ paged kernel, one row at a time with a fixed
    # reduction order, so a token's result never depends on its batch, its prompt's
    # chunking or a prefix-cache hit; and Linear without its batch-size-dependent path
    batch_invariant: bool = False
    # batch-invariant mode's linear kernel: auto (measured at load) or a forced candidate
    batch_invariant_linear: str = "auto"
    # MLA decode rows in the absorbed form (engine/models/mla.py); off: the expanded form,
    # as prefill rows run (a cross-check: the two differ by float rounding only)
    mla_absorbed_decode: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelOptions:
        """The defaults, less what the user switched off with `<VARIABLE>=0`."""
        env = os.environ if environ is None else environ
        return cls(cpu_attention_kernel=env.get(ATTENTION_KERNEL_ENV, "1") != "0",
                   cpu_fused_ops=env.get(FUSED_OPS_ENV, "1") != "0",
                   cpu_packed_linear=env.get(PACKED_LINEAR_ENV, "1") != "0",
                   cpu_epilogue_silu_mul=env.get(EPILOGUE_SILU_MUL_ENV, "1") != "0",
                   cpu_decode_layers=env.get(DECODE_LAYERS_ENV, "1") != "0",
                   cpu_prefill_tiles=env.get(PREFILL_TILES_ENV, "1") != "0",
                   cpu_bf16_gemm=env.get(BF16_GEMM_ENV, "1") != "0",
                   cpu_prefill_attention=_path(env.get(PREFILL_ATTENTION_ENV),
                                               PREFILL_ATTENTION_ENV, PREFILL_ATTENTION_PATHS),
                   cpu_decode_attention=_path(env.get(DECODE_ATTENTION_ENV),
                                              DECODE_ATTENTION_ENV, DECODE_ATTENTION_PATHS),
                   cpu_bf16_gemm_measure=env.get(BF16_GEMM_ENV, "1") not in ("always",
                                                                               "brgemm"),
                   cpu_bf16_gemm_kernel=("brgemm" if env.get(BF16_GEMM_ENV) == "brgemm"
                                         else "bf16_gemm"),
                   batch_invariant_linear=env.get(BATCH_INVARIANT_LINEAR_ENV, "") or "auto",
                   mla_absorbed_decode=env.get(MLA_ABSORBED_DECODE_ENV, "1") != "0")

    @classmethod
    def torch_only(cls) -> KernelOptions:
        """No C++ kernel, SDPA decode: the path every non-CPU device takes."""
        return cls(cpu_attention_kernel=False, cpu_fused_ops=False, cpu_grouped_decode=False,
                   cpu_packed_linear=False, cpu_epilogue_silu_mul=False,
                   cpu_decode_layers=False, cpu_prefill_tiles=False, cpu_bf16_gemm=False)

    def for_device(self, device: torch.device | str) -> KernelOptions:
        """These options for a model on `device`: the C++ kernels are CPU-only, so
        elsewhere they are off (and never built)."""
        if torch.device(device).type == "cpu":
            return self
        return replace(self, cpu_attention_kernel=False, cpu_fused_ops=False,
                       cpu_packed_linear=False, cpu_epilogue_silu_mul=False,
                       cpu_decode_layers=False, cpu_prefill_tiles=False, cpu_bf16_gemm=False)


def _path(value: str | None, env: str, paths: tuple[str, ...]) -> str:
    if not value:
        return "measure"
    if value not in ("measure", *paths):
        raise ValueError(f"{env}={value!r}: expected measure or one of {', '.join(paths)}")
    return value


DEFAULT_KERNELS = KernelOptions()
