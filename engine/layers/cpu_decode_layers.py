"""A decode step's decoder layers in one C++ call (CPU, bfloat16, prepacked linears).

Why: a SmolLM2 decode step runs 30 layers of ~10 kernel calls each, and from Python each
call pays its own way in: a module's __call__, the checks of the layer's fast paths,
pybind's argument parsing, torch.ops' boxed dispatch (~3 us a GEMM). At batch 1-32 that
was 4-5 ms a step (10-20% of it). Here one call runs every layer, making the same kernel
calls in the same order with the same arguments: the oneDNN GEMMs through torch's typed
dispatcher (mkldnn::_linear_pointwise and its .binary epilogue), the fused ops and the
paged attention through their own compiled code (their extensions hand over the
functions' addresses, `kernel_table`, so both paths run one build of each kernel). The
result is bit-identical to the Python layers' (tests/unit/test_cpu_decode_layers.py).

Serves decode-only forwards whose attention runs on the C++ paged kernel (plain decode
rows or k+1-row verify runs); prefill steps keep the Python layers, where the GEMMs
dominate. Used by DecoderForCausalLM when its KernelOptions turn `cpu_decode_layers` on
and every piece is there (engine/models/decoder.py `DecoderForCausalLM.decode_layers`);
PDSERVE_CPU_DECODE_LAYERS=0 switches it off.

Per layer, `weights` holds 13 tensors: input norm weight, packed qkv, qkv bias (an empty
tensor when none), packed o_proj, post-attention norm weight, packed gate half, packed up
half (both empty when the MLP's epilogue path is off), packed gate/up, packed down, then
the copies engine/layers/cpu_bf16_gemm.py streams of qkv, o_proj, gate/up (its
silu(gate) * up layout) and down (empty when the model has none). A linear with a copy
runs on it, as Linear.forward and the MLP do.
"""

from __future__ import annotations

import torch

from engine.layers import cpu_bf16_gemm, cpu_fused_ops, cpu_paged_attention
from engine.layers.cpu_extension import CpuExtension

TENSORS_PER_LAYER = 13

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cstdint>
#include <vector>

namespace {

using RopeFn = void (*)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t);
using WriteFn = void (*)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor);
using NormFn = std::vector<at::Tensor> (*)(at::Tensor, c10::optional<at::Tensor>, at::Tensor,
                                           double);
using AttnFn = at::Tensor (*)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                              int64_t, double);
using GemmFn = at::Tensor (*)(at::Tensor, at::Tensor, at::Tensor);
using SiluMulFn = at::Tensor (*)(at::Tensor, at::Tensor);

using LinearSig = at::Tensor(const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, c10::string_view,
                             c10::List<std::optional<at::Scalar>>,
                             std::optional<c10::string_view>);
using BinarySig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, c10::string_view);

// the Python layers call torch.ops.mkldnn._linear_pointwise(x, w, bias, attr, [], "")
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                  c10::string_view attr) {
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearSig>();
  return op.call(x, w, b, attr, c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// ... and .binary(x, other, w, None, "mul") for the up half's epilogue
at::Tensor linear_mul(const at::Tensor& x, const at::Tensor& other, const at::Tensor& w) {
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary").typed<BinarySig>();
  return op.call(x, other, w, std::nullopt, "mul");
}

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

}  // namespace

// -> [x, residual, the residual stream after each layer in `aux` ...]
std::vector<at::Tensor> decode_layers(
    at::Tensor x, std::vector<at::Tensor> weights, std::vector<at::Tensor> k_caches,
    std::vector<at::Tensor> v_caches, at::Tensor positions, at::Tensor cos, at::Tensor sin,
    at::Tensor slots, at::Tensor block_tables, at::Tensor kv_lens, std::vector<int64_t> table,
    std::vector<int64_t> dims, double eps, double scale, std::vector<int64_t> aux) {
  TORCH_CHECK(table.size() == 6, "decode_layers: the kernel table has 6 entries");
  TORCH_CHECK(dims.size() == 7,
              "decode_layers: dims = rows, Hq, Hkv, D, inter, silu_rows, bf16_gemm");
  const auto rope = reinterpret_cast<RopeFn>(table[0]);
  const auto write_kv = reinterpret_cast<WriteFn>(table[1]);
  const auto norm = reinterpret_cast<NormFn>(table[2]);
  const auto attn = reinterpret_cast<AttnFn>(table[3]);
  const auto bf16_gemm = reinterpret_cast<GemmFn>(table[4]);
  const auto bf16_silu_mul = reinterpret_cast<SiluMulFn>(table[5]);
  const int64_t rows = dims[0], Hq = dims[1], Hk = dims[2], D = dims[3], inter = dims[4];
  const int64_t silu_rows = dims[5];
  const bool copies = dims[6] != 0;
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 13 * L &&
              static_cast<int64_t>(v_caches.size()) == L,
              "decode_layers: 13 weight tensors and one K and V cache per layer");
  const int64_t t = x.size(0);
  const at::Tensor none = at::empty({0}, x.options());
  // Linear.forward: cpu_bf16_gemm when the layer has its copy, oneDNN otherwise
  auto lin = [&](const at::Tensor& in, const at::Tensor& packed, const at::Tensor& copy,
                 const at::Tensor& bias) {
    return copies && copy.numel() ? bf16_gemm(in, copy, bias)
                                  : linear(in, packed, maybe(bias), "none");
  };
  TORCH_CHECK(t % rows == 0 && block_tables.size(0) >= t / rows,
              "decode_layers: x must hold `rows` rows per sequence of the block tables");
  const at::Tensor tables = block_tables.slice(0, 0, t / rows);
  std::vector<at::Tensor> out(2);
  c10::optional<at::Tensor> residual;
  size_t next_aux = 0;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + 13 * l;
    auto hr = norm(x.contiguous(), residual ? c10::optional<at::Tensor>(residual->contiguous())
                                            : c10::nullopt, w[0], eps);
    residual = hr[1];
    const at::Tensor qkv = lin(hr[0], w[1], w[9], w[2]);
    rope(qkv, positions, cos, sin, Hq + Hk, D);
    const at::Tensor qk = qkv.slice(1, 0, (Hq + Hk) * D).view({t, Hq + Hk, D});
    const at::Tensor q = qk.slice(1, 0, Hq), k = qk.slice(1, Hq, Hq + Hk);
    const at::Tensor v = qkv.slice(1, (Hq + Hk) * D).view({t, Hk, D});
    write_kv(k, v, k_caches[l], v_caches[l], slots);
    const at::Tensor o = attn(q, k_caches[l], v_caches[l], tables, kv_lens, rows, scale);
    const at::Tensor a = lin(o.reshape({t, Hq * D}), w[3], w[10], none);
    hr = norm(a, residual->contiguous(), w[4], eps);
    residual = hr[1];
    const at::Tensor& h = hr[0];
    at::Tensor act;
    if (copies && w[11].numel()) {
      act = bf16_silu_mul(h, w[11]);
    } else if (w[5].numel() && t >= silu_rows) {
      act = linear_mul(h, linear(h, w[5], std::nullopt, "swish"), w[6]);
    } else {
      const at::Tensor gu = linear(h, w[7], std::nullopt, "none");
      act = at::silu(gu.slice(1, 0, inter)) * gu.slice(1, inter);
    }
    x = lin(act, w[8], w[12], none);
    if (next_aux < aux.size() && aux[next_aux] == l) {
      out.push_back(x + *residual);
      ++next_aux;
    }
  }
  out[0] = x;
  out[1] = *residual;
  return out;
}
"""

EXTENSION = CpuExtension("pdserve_cpu_decode_layers_v4", _SOURCE, ["decode_layers"],
                         ["-fno-math-errno"], "CPU decode layers")


def available() -> bool:
    """True when this extension and the two whose kernels it calls are built here."""
    return (EXTENSION.load() is not None and cpu_fused_ops.available()
            and cpu_paged_attention.kernel() is not None)


def kernel_table(bf16_gemm: bool) -> list[int]:
    """rope_, write_kv, add_rms_norm, paged_decode_attention and (with `bf16_gemm`, for a
    model whose linears have its copies; 0s otherwise) cpu_bf16_gemm's GEMM and its
    silu(gate) * up form: their compiled code's addresses, from the extensions the
    Python layers call."""
    return (list(cpu_fused_ops.EXTENSION.load().kernel_table())
            + list(cpu_paged_attention.kernel().kernel_table())
            + (cpu_bf16_gemm.kernel_table() if bf16_gemm else [0, 0]))


def decode_layers(x: torch.Tensor, weights: list[torch.Tensor], k_caches: list[torch.Tensor],
                  v_caches: list[torch.Tensor], positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                  kv_lens: torch.Tensor, table: list[int], dims: list[int], eps: float,
                  scale: float, aux_layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """[x, residual, aux streams...] after every layer; `dims` = [rows, Hq, Hkv, head_dim,
    intermediate, rows from which the MLP takes the GEMM epilogues, whether the model
    has cpu_bf16_gemm's copies (1) or not (0)]."""
    return EXTENSION.load().decode_layers(x, weights, k_caches, v_caches, positions, cos, sin,
                                          slot_mapping, block_tables, kv_lens, table, dims,
                                          eps, scale, list(aux_layers))
