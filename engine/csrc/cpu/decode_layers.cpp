// A decode step's decoder layers in one call: why in engine/layers/cpu_decode_layers.py.
// It calls the other kernels as the functions ops.h declares (one build of each) and the
// oneDNN GEMMs through torch's typed dispatcher, in the Python layers' order.

#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <cstdint>
#include <vector>

namespace pdserve {

namespace {

using LinearSig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             c10::string_view, c10::List<std::optional<at::Scalar>>,
                             std::optional<c10::string_view>);
using BinarySig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, c10::string_view);

// the Python layers call torch.ops.mkldnn._linear_pointwise(x, w, bias, attr, [], "")
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                  c10::string_view attr) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<LinearSig>();
  return op.call(x, w, b, attr, c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// ... and .binary(x, other, w, None, "mul") for the up half's epilogue
at::Tensor linear_mul(const at::Tensor& x, const at::Tensor& other, const at::Tensor& w) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                       .typed<BinarySig>();
  return op.call(x, other, w, std::nullopt, "mul");
}

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

}  // namespace

// -> [x, residual, the residual stream after each layer in `aux` ...]
std::vector<at::Tensor> decode_layers(at::Tensor x, std::vector<at::Tensor> weights,
                                      std::vector<at::Tensor> k_caches,
                                      std::vector<at::Tensor> v_caches, at::Tensor positions,
                                      at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                      at::Tensor block_tables, at::Tensor kv_lens,
                                      std::vector<int64_t> dims, double eps, double scale,
                                      std::vector<int64_t> aux) {
  TORCH_CHECK(dims.size() == 11,
              "decode_layers: dims = rows, Hq, Hkv, D, inter, silu_rows, the kernel of "
              "the qkv, o, gate/up and down copies (0 none, 1 bf16_gemm, 2 brgemm), and the "
              "paged attention's path (0 vector, 1 amx)");
  const int64_t rows = dims[0], Hq = dims[1], Hk = dims[2], D = dims[3], inter = dims[4];
  const int64_t silu_rows = dims[5];
  const int64_t k_qkv = dims[6], k_o = dims[7], k_gu = dims[8], k_down = dims[9];
  const auto attention = dims[10] == 1 ? paged_decode_attention_amx : paged_decode_attention;
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(
      static_cast<int64_t>(weights.size()) == 13 * L && static_cast<int64_t>(v_caches.size()) == L,
      "decode_layers: 13 weight tensors and one K and V cache per layer");
  const int64_t t = x.size(0);
  const at::Tensor none = at::empty({0}, x.options());
  // Linear.forward: cpu_bf16_gemm's kernel `kernel` when the layer has its copy, oneDNN
  // otherwise
  auto lin = [&](const at::Tensor& in, const at::Tensor& packed, const at::Tensor& copy,
                 const at::Tensor& bias, int64_t kernel) {
    if (kernel == 0 || !copy.numel()) return linear(in, packed, maybe(bias), "none");
    return kernel == 2 ? bf16_gemm_brgemm(in, copy, bias) : bf16_gemm(in, copy, bias);
  };
  TORCH_CHECK(t % rows == 0 && block_tables.size(0) >= t / rows,
              "decode_layers: x must hold `rows` rows per sequence of the block tables");
  const at::Tensor tables = block_tables.slice(0, 0, t / rows);
  std::vector<at::Tensor> out(2);
  std::optional<at::Tensor> residual;
  size_t next_aux = 0;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + 13 * l;
    auto hr = add_rms_norm(
        x.contiguous(), residual ? std::optional<at::Tensor>(residual->contiguous()) : std::nullopt,
        w[0], eps);
    residual = hr[1];
    const at::Tensor qkv = lin(hr[0], w[1], w[9], w[2], k_qkv);
    rope_(qkv, positions, cos, sin, Hq + Hk, D);
    const at::Tensor qk = qkv.slice(1, 0, (Hq + Hk) * D).view({t, Hq + Hk, D});
    const at::Tensor q = qk.slice(1, 0, Hq), k = qk.slice(1, Hq, Hq + Hk);
    const at::Tensor v = qkv.slice(1, (Hq + Hk) * D).view({t, Hk, D});
    write_kv(k, v, k_caches[l], v_caches[l], slots);
    const at::Tensor o = attention(q, k_caches[l], v_caches[l], tables, kv_lens, rows, scale);
    const at::Tensor a = lin(o.reshape({t, Hq * D}), w[3], w[10], none, k_o);
    hr = add_rms_norm(a, residual->contiguous(), w[4], eps);
    residual = hr[1];
    const at::Tensor& h = hr[0];
    at::Tensor act;
    if (k_gu != 0 && w[11].numel()) {
      act = k_gu == 2 ? bf16_gemm_brgemm_silu_mul(h, w[11]) : bf16_gemm_silu_mul(h, w[11]);
    } else if (w[5].numel() && t >= silu_rows) {
      act = linear_mul(h, linear(h, w[5], std::nullopt, "swish"), w[6]);
    } else {
      const at::Tensor gu = linear(h, w[7], std::nullopt, "none");
      act = at::silu(gu.slice(1, 0, inter)) * gu.slice(1, inter);
    }
    x = lin(act, w[8], w[12], none, k_down);
    if (next_aux < aux.size() && aux[next_aux] == l) {
      out.push_back(x + *residual);
      ++next_aux;
    }
  }
  out[0] = x;
  out[1] = *residual;
  return out;
}

}  // namespace pdserve
