// Batch-invariant linear for any CPU: y = x W^T (+ bias), each output summed over k in
// order, in float32, whatever rows share the call.
//
// Why: batch-invariant mode (engine/layers/batch_invariant.py) needs a row's result to be
// the same bits alone and beside any other rows. oneDNN and MKL choose their kernels and
// their K blocking by the row count (on an AMX Xeon no padding of the row count gives a
// bf16 row the same bits), and the weight-streaming GEMM (cpu_bf16_gemm) needs
// AVX512-BF16. This kernel holds everywhere by construction:
// - every output y[m, n] is acc = 0; for k in 0..K-1: acc = acc + x[m, k] * w[n, k], in
//   float32, then + bias[n], rounded once to the output dtype;
// - it is compiled with -ffp-contract=off, so a multiply and an add are rounded as two
//   operations on every code path (vector body, scalar tail, 1- to 4-row groups alike):
//   which path a row takes cannot change its bits;
// - threads split the work by rows and column blocks, never along k.
// The weight is read transposed ([K, N], `prepare` in the Python wrapper), so the inner
// loop runs along N over contiguous memory and the compiler vectorizes it.
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

namespace pdserve {
namespace {

constexpr int64_t COLS = 32;  // output columns a block accumulates in registers
constexpr int64_t ROWS = 4;   // rows sharing one pass over a block's weights

inline float as_float(float v) {
  return v;
}
inline float as_float(c10::BFloat16 v) {
  return static_cast<float>(v);
}

// rows [0, R) of x (row stride xs) times the columns [n0, n0 + cols) of wt [K, N]
template <typename T, int R>
void block(const T* x, int64_t xs, const T* wt, int64_t N, int64_t K, int64_t n0, int64_t cols,
           const float* bias, T* y, int64_t ys) {
  float acc[R][COLS];
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < COLS; ++j) acc[r][j] = 0.0f;
  float wf[COLS];
  for (int64_t k = 0; k < K; ++k) {
    const T* w = wt + k * N + n0;
    for (int64_t j = 0; j < cols; ++j) wf[j] = as_float(w[j]);
    for (int r = 0; r < R; ++r) {
      const float xv = as_float(x[r * xs + k]);
      for (int64_t j = 0; j < cols; ++j) acc[r][j] = acc[r][j] + xv * wf[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < cols; ++j)
      y[r * ys + n0 + j] = static_cast<T>(bias ? acc[r][j] + bias[n0 + j] : acc[r][j]);
}

template <typename T>
void run(const T* x, int64_t M, int64_t K, const T* wt, int64_t N, const float* bias, T* y) {
  const int64_t groups = (M + ROWS - 1) / ROWS, blocks = (N + COLS - 1) / COLS;
  at::parallel_for(0, groups * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / blocks, n0 = (t % blocks) * COLS;
      const int64_t m0 = g * ROWS, rows = std::min(ROWS, M - m0);
      const int64_t cols = std::min(COLS, N - n0);
      const T* xg = x + m0 * K;
      T* yg = y + m0 * N;
      switch (rows) {
        case 4:
          block<T, 4>(xg, K, wt, N, K, n0, cols, bias, yg, N);
          break;
        case 3:
          block<T, 3>(xg, K, wt, N, K, n0, cols, bias, yg, N);
          break;
        case 2:
          block<T, 2>(xg, K, wt, N, K, n0, cols, bias, yg, N);
          break;
        default:
          block<T, 1>(xg, K, wt, N, K, n0, cols, bias, yg, N);
          break;
      }
    }
  });
}

}  // namespace

// x [M, K] (float32 or bf16, contiguous) times wt [K, N] (the weight transposed, same
// dtype, contiguous), plus an optional bias [N] (an empty tensor for none) -> [M, N]
at::Tensor fixed_order_linear(at::Tensor x, at::Tensor wt, at::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && wt.dim() == 2 && x.size(1) == wt.size(0),
              "fixed_order_linear: x [M, K] and wt [K, N] expected, got ", x.sizes(), " and ",
              wt.sizes());
  TORCH_CHECK(x.scalar_type() == wt.scalar_type(), "fixed_order_linear: x is ", x.scalar_type(),
              ", the weight ", wt.scalar_type());
  TORCH_CHECK(x.is_contiguous() && wt.is_contiguous(),
              "fixed_order_linear: contiguous "
              "x and weight expected");
  const int64_t M = x.size(0), K = x.size(1), N = wt.size(1);
  at::Tensor fbias;
  if (bias.numel()) {
    TORCH_CHECK(bias.numel() == N, "fixed_order_linear: bias of ", bias.numel(), " values for ", N,
                " outputs");
    fbias = bias.to(at::kFloat).contiguous();
  }
  const float* bp = bias.numel() ? fbias.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    run<float>(x.data_ptr<float>(), M, K, wt.data_ptr<float>(), N, bp, y.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16,
                "fixed_order_linear: float32 or bfloat16, "
                "got ",
                x.scalar_type());
    run<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), M, K, wt.data_ptr<c10::BFloat16>(), N, bp,
                       y.data_ptr<c10::BFloat16>());
  }
  return y;
}

}  // namespace pdserve
