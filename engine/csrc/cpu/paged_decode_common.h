// What the paged decode kernel's two bf16 paths share (paged_attention.cpp, the vector
// path; paged_attention_amx.cpp, the tile-scored one): the block prefetch, the split of
// (row, KV head) items over the threads, and the V pass's widening of bf16 rows and the
// final store. Internal linkage, as in vec.h: each file compiles its own copy under its
// own flags.
#pragma once

#include "vec.h"

#include <ATen/ATen.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace pdserve {
namespace {

// blocks sit anywhere in the cache: ask for the next one while this one is computed.
// Into L2 (locality 2, PREFETCHT1), not L1: a 2 KB block is 32 lines, and asking L1 for
// them filled its few miss buffers, stalling the loads of the block being computed.
// Measured (30 layers of SmolLM2's KV, 2 threads): batch 35 x 400 tokens 17.2 -> 12.8 ms,
// 64 x 200 18.8 -> 13.2 ms, 8 x 1024 9.3 -> 7.9 ms. Locality 1 was the same as 2.
template <typename T>
inline void prefetch_block(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(c + off, 0, 2);
}

// the split of (row i / Hk, KV head i % Hk) items over the threads: an item costs its keys
// (never past the table's max_keys) plus a row's fixed work
inline std::vector<int64_t> item_costs(const int* lens, int64_t items, int64_t Hk,
                                       int64_t max_keys) {
  std::vector<int64_t> cost(items + 1, 0);
  for (int64_t i = 0; i < items; ++i)
    cost[i + 1] = cost[i] + std::min<int64_t>(lens[i / Hk], max_keys) + 32;
  return cost;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// a 64-wide bf16 row widened to float32 as its even and odd elements (shift, mask: 2
// instructions per 32 where a conversion takes 4), and four such accumulators put back in
// head_dim order, scaled and rounded to bf16 once a row
struct EvenOdd64 {
  __m512i lo, hi, upper;
  EvenOdd64() {
    alignas(64) int32_t l_idx[16], h_idx[16];
    for (int l = 0; l < 16; ++l) {
      l_idx[l] = (l % 2 ? 16 : 0) + l / 2;
      h_idx[l] = (l % 2 ? 16 : 0) + 8 + l / 2;
    }
    lo = _mm512_load_si512(l_idx);
    hi = _mm512_load_si512(h_idx);
    upper = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  }
  // f = even and odd elements of 0-31, then of 32-63
  void widen(const at::BFloat16* row, __m512 f[4]) const {
    const __m512i raw0 = _mm512_loadu_si512(row), raw1 = _mm512_loadu_si512(row + 32);
    f[0] = _mm512_castsi512_ps(_mm512_slli_epi32(raw0, 16));
    f[1] = _mm512_castsi512_ps(_mm512_and_si512(raw0, upper));
    f[2] = _mm512_castsi512_ps(_mm512_slli_epi32(raw1, 16));
    f[3] = _mm512_castsi512_ps(_mm512_and_si512(raw1, upper));
  }
  // acc[0..3] as `widen` lays them out, times `inv`, to 64 bf16 at `o`
  void store(at::BFloat16* o, const __m512* acc, float inv) const {
    const __m512 iv = _mm512_set1_ps(inv);
    for (int half = 0; half < 2; ++half) {
      const __m512 even = acc[2 * half], odd = acc[2 * half + 1];
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(o + 32 * half),
          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_permutex2var_ps(even, lo, odd), iv)));
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(o + 32 * half + 16),
          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_permutex2var_ps(even, hi, odd), iv)));
    }
  }
};
#endif

}  // namespace
}  // namespace pdserve
