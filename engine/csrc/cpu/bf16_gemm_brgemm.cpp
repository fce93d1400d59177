// The weight-streaming bf16 GEMM's packed weights (bf16_gemm.cpp: [N/32, K/2, 32, 2], each
// 32-column block a VNNI matrix) multiplied on oneDNN's brgemm micro-kernel instead of
// VDPBF16PS loops: AMX tiles where the CPU has them. Used by engine/layers/cpu_bf16_gemm.py.
//
// Why: on an AMX Xeon, oneDNN's own matmul at decode row counts (1-64) reached ~0.5 TFLOP/s
// and ~8 GB/s of weights (SmolLM2, 64 rows: 35 ms of an 84 ms step), well under the memory
// stream, and the VDPBF16PS kernel lost to it 2x. Here each thread streams its own column
// blocks once (the two threads never read the same weight bytes), the rows stay in cache,
// and each block is one micro-kernel call: rows x 32 columns x K, float32 accumulators,
// then the epilogue (bias, or silu(gate) * up for a fused gate/up block) rounds to bf16 once.
//
// A row's result does not depend on the other rows of the call (the micro-kernel's K loop
// is the same for every row count), but it is not bf16_gemm.cpp's bits: those sum k-pairs
// one at a time, the tiles sum 32 k at once.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <vector>

namespace pdserve {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PDSERVE_GEMM_BRGEMM 1

namespace {

constexpr int64_t MAX_ROWS = 64;  // rows a call; more go in slices of this

at::Tensor run(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& bias, bool silu) {
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == 32 && wp.size(3) == 2 &&
                  wp.scalar_type() == at::kBFloat16 && wp.is_contiguous(),
              "bf16_gemm_brgemm: the weight must come from bf16_gemm.pack / pack_silu_mul");
  const int64_t NB = wp.size(0), KP = wp.size(1), K = 2 * KP, N = NB * (silu ? 16 : 32);
  TORCH_CHECK(
      x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == K && x.stride(1) == 1,
      "bf16_gemm_brgemm: x must be [rows, K] bfloat16 with unit column stride");
  TORCH_CHECK(!bias.numel() || (!silu && bias.numel() == N && bias.scalar_type() == at::kBFloat16),
              "bf16_gemm_brgemm: the bias must be bfloat16 [N] (none with silu_mul)");
  const int64_t M = x.size(0), lda = x.stride(0), cols = silu ? 16 : 32;
  auto y = at::empty({M, N}, x.options());
  std::vector<float> fbias;
  if (bias.numel()) {
    const at::Tensor b = bias.contiguous();
    const at::BFloat16* bp = b.data_ptr<at::BFloat16>();
    fbias.resize(N);
    for (int64_t n = 0; n < N; ++n) fbias[n] = static_cast<float>(bp[n]);
  }
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* w = wp.data_ptr<at::BFloat16>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float c[MAX_ROWS * 32];
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int64_t mr = std::min(MAX_ROWS, M - m0);
      for (int64_t b = b0; b < b1; ++b) {
        at::native::cpublas::brgemm(mr, 32, K, lda, 32, 32, false, xp + m0 * lda, w + b * K * 32,
                                    c);
        for (int64_t m = 0; m < mr; ++m) {
          __m512 lo = _mm512_load_ps(c + m * 32), hi = _mm512_load_ps(c + m * 32 + 16);
          uint16_t* out = yp + (m0 + m) * N + b * cols;
          if (silu) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                                (__m256i)_mm512_cvtneps_pbh(silu_mul16(lo, hi)));
            continue;
          }
          if (!fbias.empty()) {  // after the sum, as oneDNN adds it
            lo = _mm512_add_ps(lo, _mm512_loadu_ps(fbias.data() + b * 32));
            hi = _mm512_add_ps(hi, _mm512_loadu_ps(fbias.data() + b * 32 + 16));
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(lo));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16),
                              (__m256i)_mm512_cvtneps_pbh(hi));
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return y;
}

bool self_test() {
  try {
    auto w = at::randn({64, 64}).to(at::kBFloat16);
    auto x = at::randn({5, 64}).to(at::kBFloat16);
    auto got = run(x, bf16_gemm_pack(w), at::empty({0}, x.options()), false).to(at::kFloat);
    auto want = at::matmul(x.to(at::kFloat), w.to(at::kFloat).t());
    return at::allclose(got, want, 1e-2, 1e-2);
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace
#endif

bool bf16_gemm_brgemm_available() {
#ifdef PDSERVE_GEMM_BRGEMM
  static const bool ok = self_test();
  return ok;
#else
  return false;
#endif
}

at::Tensor bf16_gemm_brgemm(at::Tensor x, at::Tensor wp, at::Tensor bias) {
  TORCH_CHECK(bf16_gemm_brgemm_available(),
              "bf16_gemm_brgemm: oneDNN's bf16 brgemm micro-kernel is not usable here");
#ifdef PDSERVE_GEMM_BRGEMM
  return run(x, wp, bias, false);
#else
  return at::Tensor();
#endif
}

at::Tensor bf16_gemm_brgemm_silu_mul(at::Tensor x, at::Tensor wp) {
  TORCH_CHECK(bf16_gemm_brgemm_available(),
              "bf16_gemm_brgemm: oneDNN's bf16 brgemm micro-kernel is not usable here");
#ifdef PDSERVE_GEMM_BRGEMM
  return run(x, wp, at::empty({0}, x.options()), true);
#else
  return at::Tensor();
#endif
}

}  // namespace pdserve
