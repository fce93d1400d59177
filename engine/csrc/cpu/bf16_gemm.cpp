// The weight-streaming bf16 GEMM (AVX512-BF16): why and how in engine/layers/
// cpu_bf16_gemm.py. Used there, by batch-invariant mode and by decode_layers.cpp.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>

namespace pdserve {

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t PREFETCH_AHEAD = 64;  // in 64-byte lines of the weight stream (4 KB)
constexpr int64_t MAX_GROUP = 8;        // rows per pass over a block (16 accumulators)

// rows [0, MR) of x (k-pairs as uint32, row stride xs) times one 32-column block; with
// SILU_MUL the block's columns are 16 gate and the 16 matching up columns, and the row
// gets silu(gate) * up in 16 columns
template <int MR, bool SILU_MUL>
inline void block_rows(const uint32_t* x, int64_t xs, const __m512i* wb, int64_t KP,
                       const float* bias, uint16_t* y, int64_t ys) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(wb + 2 * kp + PREFETCH_AHEAD), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + 2 * kp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + 2 * kp + 1);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * xs + kp]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
    }
  }
  if constexpr (SILU_MUL) {
    for (int m = 0; m < MR; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ys),
                          (__m256i)_mm512_cvtneps_pbh(silu_mul16(acc[m][0], acc[m][1])));
    return;
  }
  for (int m = 0; m < MR; ++m) {
    if (bias) {  // after the sum, as oneDNN and x @ W^T + b in float32 add it
      acc[m][0] = _mm512_add_ps(acc[m][0], _mm512_loadu_ps(bias));
      acc[m][1] = _mm512_add_ps(acc[m][1], _mm512_loadu_ps(bias + 16));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ys),
                        (__m256i)_mm512_cvtneps_pbh(acc[m][0]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ys + 16),
                        (__m256i)_mm512_cvtneps_pbh(acc[m][1]));
  }
}

using BlockFn = void (*)(const uint32_t*, int64_t, const __m512i*, int64_t, const float*, uint16_t*,
                         int64_t);
template <bool S>
constexpr BlockFn BLOCK_FNS[MAX_GROUP] = {block_rows<1, S>, block_rows<2, S>, block_rows<3, S>,
                                          block_rows<4, S>, block_rows<5, S>, block_rows<6, S>,
                                          block_rows<7, S>, block_rows<8, S>};
#endif

// column c of block b: weight row src_row(b, c); its k-pair p at [b, p, c]
template <typename RowOf>
at::Tensor pack_blocks(const at::Tensor& w, int64_t blocks, RowOf src_row) {
  const int64_t K = w.size(1);
  const at::Tensor src = w.contiguous();
  auto out = at::empty({blocks, K / 2, 32, 2}, w.options());
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
  uint16_t* d = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < 32; ++c) {
        const uint16_t* row = s + src_row(b, c) * K;
        for (int64_t p = 0; p < K / 2; ++p) {
          uint16_t* o = d + ((b * (K / 2) + p) * 32 + c) * 2;
          o[0] = row[2 * p];
          o[1] = row[2 * p + 1];
        }
      }
  });
  return out;
}

void check_weight(const at::Tensor& w, int64_t rows_multiple, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, what, ": a 2-D bfloat16 weight");
  TORCH_CHECK(w.size(0) % rows_multiple == 0 && w.size(1) % 2 == 0, what,
              ": rows a multiple "
              "of ",
              rows_multiple, " and an even number of columns");
}

}  // namespace

// w [N, K] -> [N/32, K/2, 32, 2]: block b holds columns 32b..32b+31
at::Tensor bf16_gemm_pack(at::Tensor w) {
  check_weight(w, 32, "bf16_gemm.pack");
  return pack_blocks(w, w.size(0) / 32, [](int64_t b, int64_t c) { return 32 * b + c; });
}

// a fused gate/up weight [2 inter, K] (gate rows first) -> [inter/16, K/2, 32, 2]: block b
// holds gate columns 16b..16b+15, then the same up columns
at::Tensor bf16_gemm_pack_silu_mul(at::Tensor w) {
  check_weight(w, 32, "bf16_gemm.pack_silu_mul");
  const int64_t inter = w.size(0) / 2;
  TORCH_CHECK(inter % 16 == 0, "bf16_gemm.pack_silu_mul: inter a multiple of 16");
  return pack_blocks(w, inter / 16, [inter](int64_t b, int64_t c) {
    return c < 16 ? 16 * b + c : inter + 16 * b + (c - 16);
  });
}

namespace {

at::Tensor run(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& bias, bool silu) {
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == 32 && wp.size(3) == 2 &&
                  wp.scalar_type() == at::kBFloat16 && wp.is_contiguous(),
              "bf16_gemm: the weight must come from bf16_gemm.pack / pack_silu_mul");
  const int64_t NB = wp.size(0), KP = wp.size(1), N = NB * (silu ? 16 : 32);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == 2 * KP &&
                  x.stride(1) == 1 && x.stride(0) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0,
              "bf16_gemm: x must be [rows, K] bfloat16, unit column stride, rows "
              "starting on 4-byte boundaries");
  TORCH_CHECK(!bias.numel() || (!silu && bias.numel() == N && bias.scalar_type() == at::kBFloat16),
              "bf16_gemm: the bias must be bfloat16 [N] (none with silu_mul)");
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  std::vector<float> fbias;
  if (bias.numel()) {
    const at::Tensor b = bias.contiguous();
    const at::BFloat16* bp = b.data_ptr<at::BFloat16>();
    fbias.resize(N);
    for (int64_t n = 0; n < N; ++n) fbias[n] = static_cast<float>(bp[n]);
  }
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0) / 2, cols = silu ? 16 : 32;
  const __m512i* w = reinterpret_cast<const __m512i*>(wp.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const BlockFn* fns = silu ? BLOCK_FNS<true> : BLOCK_FNS<false>;
  const int64_t groups = (M + MAX_GROUP - 1) / MAX_GROUP;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* bb = fbias.empty() ? nullptr : fbias.data() + b * 32;
      for (int64_t g = 0, m0 = 0; g < groups; ++g) {  // near-equal groups: 12 = 6 + 6
        const int64_t mr = (M - m0) / (groups - g);
        fns[mr - 1](xp + m0 * xs, xs, w + b * KP * 2, KP, bb, yp + m0 * N + b * cols, N);
        m0 += mr;
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_gemm: built without AVX512-BF16");
#endif
  return y;
}

}  // namespace

bool bf16_gemm_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 (rows with unit column stride) times a `pack`ed weight, plus an optional
// bf16 bias (an empty tensor for none) -> [M, N] bf16
at::Tensor bf16_gemm(at::Tensor x, at::Tensor wp, at::Tensor bias) {
  return run(x, wp, bias, false);
}

// x times a `pack_silu_mul`ed gate/up weight -> silu(gate) * up [M, inter] bf16
at::Tensor bf16_gemm_silu_mul(at::Tensor x, at::Tensor wp) {
  return run(x, wp, at::empty({0}, x.options()), true);
}

}  // namespace pdserve
