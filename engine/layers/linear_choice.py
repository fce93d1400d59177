"""bf16 linears: the weight-streaming GEMM, its brgemm kernel or oneDNN, chosen by
measurement at load.

The weight-streaming GEMM (engine/layers/cpu_bf16_gemm.py) beat oneDNN on an AVX512-BF16
EPYC (decode steps 12-32% a layer), but on an Intel Xeon with AMX oneDNN takes the AMX
tiles and the streaming GEMM lost about 2x: SmolLM2-135M bf16, 32 x 128/128 tokens, 552-555
tok/s with it against 960-981 without. A table written for one CPU loses on the other, so
after `pack_linears` gave the layers both copies, `choose` times both on the model's own
weights for each distinct (shape, form) and each row bucket the engine uses, and keeps the
streaming GEMM only where it is faster:

- a call goes over every layer of that shape in turn (the weights come from memory as in a
  real step, not from a cache a single repeated weight would sit in), best of 3 passes
  (engine/layers/kernel_select.py; a candidate that cannot run here is skipped);
- buckets: calls of up to GEMM_SMALL_ROWS rows (decode steps, timed at 16 rows) and longer
  ones (prefill chunks, timed at 256 rows);
- the choice is kept for the machine (engine/layers/kernel_choice.py), so every process
  and node of a cluster runs the same kernels (their bf16 bits differ), and logged.

The streaming copy has two kernels (cpu_bf16_gemm.KERNELS): the VDPBF16PS loops and
oneDNN's brgemm micro-kernel on the same packed blocks (AMX tiles where present; on the AMX
Xeon it beat oneDNN's matmul at every decode row count). All three are timed for the decode
bucket, the first and oneDNN for the prefill bucket (the brgemm kernel re-reads the weights
for every 64 rows, a loss at prefill sizes the 256 timed rows do not show); a layer where
neither copy kernel wins a bucket drops its copy (memory back). `Linear.gemm_small` /
`gemm_large` name the copy kernel each bucket takes (None: oneDNN), and the one-call decode
layers get the copy and its kernel only where `gemm_small` names one.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.layers import cpu_bf16_gemm, cpu_extension, kernel_choice, kernel_select
from engine.layers.linear import (
    FUSED_SILU_MUL_ROWS,
    GEMM_SMALL_ROWS,
    SMALL_ROWS,
    Linear,
    linear_wxt,
    silu_mul_packed,
)

log = logging.getLogger(__name__)

BUCKETS = (("decode", 16), ("prefill", 4 * GEMM_SMALL_ROWS))   # rows timed


def choose(model: torch.nn.Module, pages: str = "") -> dict[str, str]:
    """Set each copy-holding Linear's buckets; returns {group and bucket: kernel}. pages:
    where the copies lie when not on the heap ("huge pages": the loader moved them there,
    engine/huge_pages.py), part of the kept choice's key, since the copies stream faster
    from huge pages (the LM head's won there and lost on 4 KB pages)."""
    groups: dict[tuple, list[Linear]] = {}
    for m in model.modules():
        if isinstance(m, Linear) and (m.gemm_packed is not None
                                      or m.gemm_silu_mul_packed is not None):
            form = "silu_mul" if m.gemm_silu_mul_packed is not None else "gemm"
            groups.setdefault((form, m.in_features, m.out_features), []).append(m)
    table = {}
    build = cpu_extension.KERNELS.build_name()
    for (form, k, n), layers in groups.items():
        won = {}
        for bucket, rows in BUCKETS:
            key = f"bf16_linear {form} [{n}, {k}] {bucket} x{len(layers)} {build}"
            key += f" on {pages}" if pages else ""
            name = kernel_choice.CHOICES.choose(
                key, lambda rows=rows, form=form, layers=layers: _measure(form, layers, rows),
                still_valid=lambda kept, rows=rows: kept in candidate_names(rows))
            won[bucket] = name if name in cpu_bf16_gemm.KERNELS else None
            table[f"{form} [{n}, {k}] {bucket}"] = name
        for m in layers:
            m.gemm_small, m.gemm_large = won["decode"], won["prefill"]
            if not (m.gemm_small or m.gemm_large):
                m.gemm_packed = m.gemm_silu_mul_packed = None
    if table:
        log.info("bf16 linear kernels chosen by measurement: %s",
                 ", ".join(f"{g}: {k}" for g, k in table.items()))
    return table


def force(model: torch.nn.Module, kernel: str) -> None:
    """Every copy-holding Linear takes the copy's `kernel` in both buckets, unmeasured
    (PDSERVE_CPU_BF16_GEMM=always|brgemm)."""
    if kernel not in cpu_bf16_gemm.KERNELS:
        raise ValueError(f"unknown bf16 copy kernel {kernel!r}; known: "
                         f"{', '.join(cpu_bf16_gemm.KERNELS)}")
    if kernel == "brgemm" and not cpu_bf16_gemm.brgemm_available():
        log.warning("the brgemm kernel of the bf16 copies does not run here (oneDNN's "
                    "micro-kernel failed its self-test); its VDPBF16PS kernel instead")
        kernel = "bf16_gemm"
    for m in model.modules():
        if isinstance(m, Linear):
            m.gemm_small = m.gemm_large = kernel


@torch.inference_mode()
def _measure(form: str, layers: list[Linear], rows: int) -> str:
    x = torch.randn(rows, layers[0].in_features).bfloat16()

    def over_layers(run):
        def load():
            run(layers[0], x)                 # raises here where the kernel cannot run
            return lambda: [run(m, x) for m in layers]
        return load

    what = f"bf16 linear {form} [{layers[0].out_features}, {layers[0].in_features}] " \
           f"at {rows} rows"
    run = {"bf16_gemm": _streaming(form, "bf16_gemm"), "brgemm": _streaming(form, "brgemm"),
           "onednn": _onednn(form)}
    best, _ = kernel_select.fastest(what, [kernel_select.Candidate(name, over_layers(run[name]))
                                           for name in candidate_names(rows)])
    return best


def candidate_names(rows: int) -> tuple[str, ...]:
    """The kernels timed for calls of `rows` rows. The brgemm kernel is a decode kernel: it
    streams the weights once per 64 rows, so a 2,048-row prefill chunk reads them 32 times
    (gate/up at 2,048 rows 171 ms against oneDNN's 100 on the AMX Xeon), which the 256
    rows timed for the prefill bucket would not show."""
    if rows <= GEMM_SMALL_ROWS:
        return ("bf16_gemm", "brgemm", "onednn")
    return ("bf16_gemm", "onednn")


def _streaming(form: str, kernel: str):
    if form == "silu_mul":
        return lambda m, x: cpu_bf16_gemm.gemm_silu_mul(x, m.gemm_silu_mul_packed, kernel)
    return lambda m, x: cpu_bf16_gemm.gemm(x, m.gemm_packed, m.bias, kernel)


def _onednn(form: str):
    """What the layer runs without the streaming copy (Linear.forward, the MLP's paths)."""
    def linear(m, x):
        return torch.ops.mkldnn._linear_pointwise(x, m.packed, m.bias, "none", [], "")

    if form == "gemm":
        return linear

    def silu_mul(m, x):
        if m.packed_halves is not None and x.shape[0] >= FUSED_SILU_MUL_ROWS:
            return silu_mul_packed(x, *m.packed_halves)
        gate, up = linear(m, x).split(m.split_rows, dim=-1)
        return F.silu(gate) * up
    return silu_mul


def choose_small_rows(model: torch.nn.Module) -> dict[str, str]:
    """float32 CPU linears over 2-4 rows: F.linear or (W @ x^T)^T, timed per shape and row
    count on the model's own weights (each over every layer of the shape, as bf16's
    choice); sets each Linear's `wxt_rows`. Kept per machine, not per thread count, so
    every process of a cluster computes the same bits (a PD prompt's rows on the prefill
    node and a single node's). Returns {shape and rows: kernel}."""
    groups: dict[tuple[int, int], list[Linear]] = {}
    for m in model.modules():
        if (isinstance(m, Linear) and m.invariant is None and m.weight.numel()
                and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"):
            groups.setdefault((m.in_features, m.out_features), []).append(m)
    table = {}
    for (k, n), layers in groups.items():
        wxt = set()
        for rows in SMALL_ROWS:
            key = f"f32_linear [{n}, {k}] {rows} rows x{len(layers)}"
            name = kernel_choice.CHOICES.choose(
                key, lambda rows=rows, layers=layers: _measure_small(layers, rows))
            table[f"f32 [{n}, {k}] {rows} rows"] = name
            if name == "w_xt":
                wxt.add(rows)
        for m in layers:
            m.wxt_rows = frozenset(wxt)
    if table:
        log.info("float32 small-row linear kernels chosen by measurement: %s",
                 ", ".join(f"{g}: {k}" for g, k in table.items()))
    return table


@torch.inference_mode()
def _measure_small(layers: list[Linear], rows: int) -> str:
    x = torch.randn(rows, layers[0].in_features)

    def over_layers(run):
        return lambda: (lambda: [run(x, m.weight, m.bias) for m in layers])

    best, _ = kernel_select.fastest(
        f"float32 linear [{layers[0].out_features}, {layers[0].in_features}] at {rows} rows",
        [kernel_select.Candidate("f_linear", over_layers(F.linear)),
         kernel_select.Candidate("w_xt", over_layers(linear_wxt))])
    return best
