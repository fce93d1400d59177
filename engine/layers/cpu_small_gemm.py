"""bf16 GEMMs over decode-sized batches (1-64 rows) that stream the weight once (CPU,
AVX512-BF16).

Why: a decode step reads every weight of the model from memory (SmolLM2-135M: 240 MB of
layer weights, far more than the L3) and, at 1-64 rows, does little work per byte. oneDNN's
kernels for these shapes stall on that stream: with weights coming from DRAM (30 layers'
worth cycled, as in a real step), SmolLM2's four layer GEMMs cost oneDNN 421 us a layer at
8 rows, 804 at 32 and 1,481 at 48 (its blocking changes at 43 rows and reads the weights
twice), this kernel 318 / 704 / 1,007 us (2 threads, AVX512-BF16 EPYC).

How: the weight is packed once, at load, into 32-column blocks of k-pairs
([N/32, K/2, 32, 2]: each block one contiguous stream, software-prefetched 4 KB ahead).
The two threads take half the column blocks each; a block's columns go through groups
of up to 8 rows, each row's 32 outputs in two float32 accumulators fed by VDPBF16PS (the
row's k-pair broadcast against the block's 32 column pairs). Sums run over k-pairs in
order, so a row's result does not depend on which other rows share the call (oneDNN's
does: its K blocking varies with the row count); the output is rounded to bf16 once, at
the end, after an optional bias, as oneDNN rounds.

Used by Linear (engine/layers/linear.py) and the one-call decode layers
(engine/layers/cpu_decode_layers.py) for 1-SMALL_GEMM_ROWS rows when the KernelOptions'
`cpu_small_gemm` is on (PDSERVE_CPU_SMALL_GEMM=0 switches it off).
"""

from __future__ import annotations

import torch

from engine.layers.cpu_extension import CpuExtension

SMALL_GEMM_ROWS = 64        # the most rows a call takes (decode batches up to 64)
BLOCK_COLS = 32             # output columns per packed block

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t PREFETCH_AHEAD = 64;    // in 64-byte lines of the weight stream (4 KB)
constexpr int64_t MAX_GROUP = 8;          // rows per pass over a block (16 accumulators)

// rows [0, MR) of x (k-pairs as uint32, row stride xs) times one 32-column block
template <int MR>
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
  for (int m = 0; m < MR; ++m) {
    if (bias) {     // after the sum, as oneDNN and x @ W^T + b in float32 add it
      acc[m][0] = _mm512_add_ps(acc[m][0], _mm512_loadu_ps(bias));
      acc[m][1] = _mm512_add_ps(acc[m][1], _mm512_loadu_ps(bias + 16));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ys),
                        (__m256i)_mm512_cvtneps_pbh(acc[m][0]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ys + 16),
                        (__m256i)_mm512_cvtneps_pbh(acc[m][1]));
  }
}

using BlockFn = void (*)(const uint32_t*, int64_t, const __m512i*, int64_t, const float*,
                         uint16_t*, int64_t);
constexpr BlockFn BLOCK_FNS[MAX_GROUP] = {block_rows<1>, block_rows<2>, block_rows<3>,
                                          block_rows<4>, block_rows<5>, block_rows<6>,
                                          block_rows<7>, block_rows<8>};
#endif

}  // namespace

bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// w [N, K] bf16 -> [N/32, K/2, 32, 2]: block b, k-pair p holds columns 32b..32b+31's
// elements 2p and 2p+1
at::Tensor pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "small_gemm.pack: a 2-D bfloat16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 2 == 0,
              "small_gemm.pack: rows a multiple of 32 and an even number of columns");
  const at::Tensor src = w.contiguous();
  auto out = at::empty({N / 32, K / 2, 32, 2}, w.options());
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
  uint16_t* d = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, N / 32, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t p = 0; p < K / 2; ++p)
        for (int64_t c = 0; c < 32; ++c) {
          uint16_t* o = d + ((b * (K / 2) + p) * 32 + c) * 2;
          o[0] = s[(b * 32 + c) * K + 2 * p];
          o[1] = s[(b * 32 + c) * K + 2 * p + 1];
        }
  });
  return out;
}

// x [M, K] bf16 (rows contiguous) times a packed weight, plus an optional bf16 bias
// (an empty tensor for none) -> [M, N] bf16
at::Tensor gemm(at::Tensor x, at::Tensor wp, at::Tensor bias) {
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == 32 && wp.size(3) == 2 &&
              wp.scalar_type() == at::kBFloat16 && wp.is_contiguous(),
              "small_gemm.gemm: the weight must come from small_gemm.pack");
  const int64_t NB = wp.size(0), KP = wp.size(1), N = NB * 32;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == 2 * KP &&
              x.stride(1) == 1 && x.stride(0) % 2 == 0 &&
              reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0,
              "small_gemm.gemm: x must be [rows, K] bfloat16, unit column stride, rows "
              "starting on 4-byte boundaries");
  TORCH_CHECK(!bias.numel() || (bias.numel() == N && bias.scalar_type() == at::kBFloat16),
              "small_gemm.gemm: the bias must be bfloat16 [N]");
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
  const int64_t xs = x.stride(0) / 2;
  const __m512i* w = reinterpret_cast<const __m512i*>(wp.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t groups = (M + MAX_GROUP - 1) / MAX_GROUP;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* bb = fbias.empty() ? nullptr : fbias.data() + b * 32;
      for (int64_t g = 0, m0 = 0; g < groups; ++g) {   // near-equal groups: 12 = 6 + 6
        const int64_t mr = (M - m0) / (groups - g);
        BLOCK_FNS[mr - 1](xp + m0 * xs, xs, w + b * KP * 2, KP, bb, yp + m0 * N + b * 32, N);
        m0 += mr;
      }
    }
  });
#else
  TORCH_CHECK(false, "small_gemm.gemm: built without AVX512-BF16");
#endif
  return y;
}

// gemm's address, for engine/layers/cpu_decode_layers.py (the same compiled code)
std::vector<int64_t> kernel_table() {
  return {reinterpret_cast<int64_t>(&gemm)};
}
"""

EXTENSION = CpuExtension("pdserve_cpu_small_gemm_v1", _SOURCE,
                         ["supported", "pack", "gemm", "kernel_table"], ["-fno-math-errno"],
                         "CPU small-batch GEMM")


def available() -> bool:
    """True when the extension is built here and this CPU runs it (AVX512-BF16)."""
    module = EXTENSION.load()
    return module is not None and bool(module.supported())


def packable(weight: torch.Tensor) -> bool:
    """Whether `pack` takes this weight: bf16 [N, K] with N a multiple of 32, K even."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.shape[0] % BLOCK_COLS == 0 and weight.shape[1] % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the [N/32, K/2, 32, 2] layout `gemm` streams."""
    return EXTENSION.load().pack(weight)


def serves(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """A call `gemm` takes: 1-SMALL_GEMM_ROWS bf16 rows on CPU, unit column stride."""
    return (x.dim() == 2 and 0 < x.shape[0] <= SMALL_GEMM_ROWS and x.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.stride(1) == 1 and x.stride(0) % 2 == 0
            and x.data_ptr() % 4 == 0 and x.shape[1] == 2 * packed.shape[1])


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
         ) -> torch.Tensor:
    """x @ W^T (+ bias) in bf16 for a weight packed by `pack`."""
    empty = x.new_empty(0) if bias is None else bias
    return EXTENSION.load().gemm(x, packed, empty)


def kernel_table() -> list[int]:
    return list(EXTENSION.load().kernel_table())
