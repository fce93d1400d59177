// Paged decode attention on CPU: decode rows (and k+1-row speculative verify runs, and
// batch-invariant mode's prefill rows one at a time) against the paged KV cache, float32
// and bf16, with an AVX512-BF16 path for bf16 and head_dim 64 (float32's with head_dim 64
// is paged_attention_f32.cpp). Used by engine/layers/cpu_paged_attention.py and, through
// ops.h, by decode_layers.cpp.

#include "cost_split.h"
#include "ops.h"
#include "paged_decode_common.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pdserve {

// element -> float; bfloat16 as its upper 16 bits (a shift the compiler vectorizes)
static inline float to_f(float x) {
  return x;
}
static inline float to_f(at::BFloat16 x) {
  return bf16_to_float(x.x);
}

// prefetch_block and item_costs: paged_decode_common.h
constexpr int64_t AHEAD = 2;  // blocks prefetched ahead (3x faster than none, measured)

// one query head's scores -> probabilities, in place, in float32
static inline void softmax_inplace(float* s, int64_t L) {
  float m = -INFINITY;
  for (int64_t p = 0; p < L; ++p) m = s[p] > m ? s[p] : m;
  float sum = 0.f;
  for (int64_t p = 0; p < L; ++p) {
    s[p] = exp_nonpos(s[p] - m);
    sum += s[p];
  }
  const float inv = 1.f / sum;
  for (int64_t p = 0; p < L; ++p) s[p] *= inv;
}

// DC > 0: head_dim known at compile time (fully unrolled, vectorized inner loops)
template <typename T, int DC>
static void paged_decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                         const at::Tensor& bt, const at::Tensor& kvlen, at::Tensor& out,
                         int64_t rows, double scale_d) {
  const int64_t N = q.size(0), Hq = q.size(1), D = DC > 0 ? DC : q.size(2);
  const int64_t qs = q.stride(0);  // q may be a view into the fused qkv rows
  const int64_t Hk = kc.size(0), NB = kc.size(1), BS = kc.size(2);
  const int64_t W = bt.size(1), G = Hq / Hk;
  const float scale = static_cast<float>(scale_d);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int* btp = bt.data_ptr<int>();
  const int* lp = kvlen.data_ptr<int>();
  T* op = out.data_ptr<T>();
  run_ranges_by_cost(item_costs(lp, N * Hk, Hk, W * BS), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), sc;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / Hk, h = i % Hk, b = r / rows;
      const int64_t L = std::min<int64_t>(lp[r], W * BS);  // never read past the table
      sc.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(qp[r * qs + (h * G + g) * D + d]);
      const int64_t nblk = (L + BS - 1) / BS;
      for (int64_t j = 0; j < std::min(nblk, AHEAD); ++j) {
        prefetch_block(kp + (h * NB + btp[b * W + j]) * BS * D, BS * D);
        prefetch_block(vp + (h * NB + btp[b * W + j]) * BS * D, BS * D);
      }
      for (int64_t j = 0; j < nblk; ++j) {  // block by block: no division per key
        const T* kb = kp + (h * NB + btp[b * W + j]) * BS * D;
        const int64_t cnt = std::min(BS, L - j * BS);
        if (j + AHEAD < nblk)
          prefetch_block(kp + (h * NB + btp[b * W + j + AHEAD]) * BS * D, BS * D);
        for (int64_t t = 0; t < cnt; ++t) {
          const T* kr = kb + t * D;
          for (int64_t d = 0; d < D; ++d) row[d] = to_f(kr[d]);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
            sc[g * L + j * BS + t] = s * scale;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_inplace(sc.data() + g * L, L);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < nblk; ++j) {
        const T* vb = vp + (h * NB + btp[b * W + j]) * BS * D;
        const int64_t cnt = std::min(BS, L - j * BS);
        if (j + AHEAD < nblk)
          prefetch_block(vp + (h * NB + btp[b * W + j + AHEAD]) * BS * D, BS * D);
        for (int64_t t = 0; t < cnt; ++t) {
          const T* vr = vb + t * D;
          for (int64_t d = 0; d < D; ++d) row[d] = to_f(vr[d]);
          for (int64_t g = 0; g < G; ++g) {
            const float w = sc[g * L + j * BS + t];
            float* a = acc.data() + g * D;
            for (int64_t d = 0; d < D; ++d) a[d] += w * row[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(r * Hq + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
// 16 float32 partial sums of q . k over a 64-wide bf16 row: two VDPBF16PS
static inline __m512 dot64(__m512i q0, __m512i q1, const at::BFloat16* k) {
  const __m512 v =
      _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q0, (__m512bh)_mm512_loadu_si512(k));
  return _mm512_dpbf16_ps(v, (__m512bh)q1, (__m512bh)_mm512_loadu_si512(k + 32));
}

// the totals of four 16-lane vectors: pairs added within 128-bit lanes (unpack, shuffle),
// then the four lanes; ~3.5 instructions a vector against ~8 for a reduce each
static inline __m128 hsum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
  const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 d = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}
// one (sequence, KV head)'s G rows of L scores -> unnormalised probabilities in place:
// max, exp_nonpos16 and the sum on 16 lanes; inv[g] = 1 / sum (the caller scales its
// accumulators once at the end instead of every probability). The scalar softmax_inplace
// was ~30% of the kernel's compute.
template <int G>
static inline void exp_rows(float* sc, int64_t L, float* inv) {
  for (int g = 0; g < G; ++g) {
    float* s = sc + g * L;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t p = 0;
    for (; p + 16 <= L; p += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + p));
    float m = _mm512_reduce_max_ps(mv);
    for (; p < L; ++p) m = s[p] > m ? s[p] : m;
    const __m512 m16 = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (p = 0; p < L; p += 16) {
      const __mmask16 k = L - p >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - p)) - 1);
      const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + p), m16));
      _mm512_mask_storeu_ps(s + p, k, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    inv[g] = L > 0 ? 1.f / _mm512_reduce_add_ps(sum) : 0.f;  // no keys (a padded row): zeros
  }
}

// bfloat16, head_dim 64, on a CPU with AVX512-BF16: a K row is two 32-lane bf16 vectors
// scored against a query head with two VDPBF16PS (bf16 pairs multiplied and summed into
// float32 lanes; a bf16 x bf16 product is exact in float32) and one horizontal sum. The
// generic loop above spent ~100 cycles a key converting every element to float first.
// Float32 softmax and accumulation; the output rounded to nearest even, as a cast.
// A decode batch is a stream of ~0.7 GB of KV a step, so memory is kept busy throughout:
// the K pass prefetches V's blocks too (the V pass then reads L2, ~50 KB a row), the V
// pass prefetches the first blocks of the thread's next (sequence, head), and threads
// split the rows by their keys, not their count. 30 layers of 64 rows x 32-712 keys, 2
// threads, AMX Xeon: 40.9 -> 34.5 ms with the blocks in order, 56.3 -> 43.9 ms shuffled.
// V rows are widened to float32 by shift and mask (even and odd elements, 2 instructions
// per 32 where the conversion took 4), the accumulators put back in order once a row:
// the same FMAs in the same order, the same bits; 35.1-36.1 -> 34.4-34.9 ms there.
constexpr int64_t NEXT_AHEAD = 4;  // blocks of the next row prefetched (8 was no better)

template <int GC>  // query heads per KV head (compile-time: accumulators in registers)
static void paged_decode_bf16_d64(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                  const at::Tensor& bt, const at::Tensor& kvlen, at::Tensor& out,
                                  int64_t rows, double scale_d) {
  constexpr int64_t D = 64;
  const int64_t N = q.size(0), Hq = q.size(1), qs = q.stride(0);
  const int64_t Hk = kc.size(0), NB = kc.size(1), BS = kc.size(2);
  const int64_t W = bt.size(1);
  constexpr int64_t G = GC;
  const float scale = static_cast<float>(scale_d);
  const at::BFloat16* qp = q.data_ptr<at::BFloat16>();
  const at::BFloat16* kp = kc.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = vc.data_ptr<at::BFloat16>();
  const int* btp = bt.data_ptr<int>();
  const int* lp = kvlen.data_ptr<int>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // item i = (row i / Hk, KV head i % Hk); never read past the table
  auto len_of = [&](int64_t i) { return std::min<int64_t>(lp[i / Hk], W * BS); };
  auto block = [&](const at::BFloat16* cache, int64_t i, int64_t j) {
    return cache + ((i % Hk) * NB + btp[(i / Hk / rows) * W + j]) * BS * D;
  };
  run_ranges_by_cost(item_costs(lp, N * Hk, Hk, W * BS), [&](int64_t begin, int64_t end) {
    const EvenOdd64 v64;  // V rows widened as even and odd elements
    std::vector<float> sc;
    __m512i qv[2 * G];
    __m512 acc[4 * G];
    float inv[G];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / Hk, h = i % Hk;
      const int64_t L = len_of(i);
      sc.resize(G * L);
      for (int64_t g = 0; g < G; ++g) {
        const at::BFloat16* qg = qp + r * qs + (h * G + g) * D;
        qv[2 * g] = _mm512_loadu_si512(qg);
        qv[2 * g + 1] = _mm512_loadu_si512(qg + 32);
      }
      const int64_t nblk = (L + BS - 1) / BS;
      for (int64_t j = 0; j < std::min(nblk, AHEAD); ++j) {
        prefetch_block(block(kp, i, j), BS * D);
        prefetch_block(block(vp, i, j), BS * D);
      }
      for (int64_t j = 0; j < nblk; ++j) {
        const at::BFloat16* kb = block(kp, i, j);
        const int64_t cnt = std::min(BS, L - j * BS);
        if (j + AHEAD < nblk) {
          prefetch_block(block(kp, i, j + AHEAD), BS * D);
          prefetch_block(block(vp, i, j + AHEAD), BS * D);
        }
        int64_t t = 0;
        for (; t + 4 <= cnt; t += 4) {  // four keys: their four sums reduced together
          for (int64_t g = 0; g < G; ++g) {
            __m512 v[4];
            for (int u = 0; u < 4; ++u) v[u] = dot64(qv[2 * g], qv[2 * g + 1], kb + (t + u) * D);
            _mm_storeu_ps(sc.data() + g * L + j * BS + t,
                          _mm_mul_ps(hsum4(v[0], v[1], v[2], v[3]), _mm_set1_ps(scale)));
          }
        }
        for (; t < cnt; ++t)
          for (int64_t g = 0; g < G; ++g)
            sc[g * L + j * BS + t] =
                _mm512_reduce_add_ps(dot64(qv[2 * g], qv[2 * g + 1], kb + t * D)) * scale;
      }
      exp_rows<G>(sc.data(), L, inv);
      const int64_t next_blocks =
          i + 1 < end ? std::min(NEXT_AHEAD, (len_of(i + 1) + BS - 1) / BS) : 0;
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t j = 0; j < nblk; ++j) {
        const at::BFloat16* vb = block(vp, i, j);
        const int64_t cnt = std::min(BS, L - j * BS);
        if (j < next_blocks) {
          prefetch_block(block(kp, i + 1, j), BS * D);
          prefetch_block(block(vp, i + 1, j), BS * D);
        }
        for (int64_t t = 0; t < cnt; ++t) {
          __m512 f[4];
          v64.widen(vb + t * D, f);
          for (int64_t g = 0; g < G; ++g) {
            const __m512 w = _mm512_set1_ps(sc[g * L + j * BS + t]);
            for (int c = 0; c < 4; ++c) acc[4 * g + c] = _mm512_fmadd_ps(w, f[c], acc[4 * g + c]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) v64.store(op + (r * Hq + h * G + g) * D, acc + 4 * g, inv[g]);
    }
  });
}
#define PDSERVE_BF16_D64 1
#endif

// whether bfloat16 with head_dim 64 and 1-4 query heads per KV head takes the AVX512-BF16
// path above (then it also beats torch's SDPA on prefill rows, one row at a time)
bool paged_bf16_d64_fast() {
#ifdef PDSERVE_BF16_D64
  return true;
#else
  return false;
#endif
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt,
                                  at::Tensor kvlen, int64_t rows, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && kc.is_contiguous() &&
                  vc.is_contiguous(),
              "paged_decode_attention: q's heads and the caches must be contiguous");
  TORCH_CHECK(bt.scalar_type() == at::kInt && kvlen.scalar_type() == at::kInt,
              "paged_decode_attention: block tables and kv lengths must be int32");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && kc.scalar_type() == vc.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % kc.size(0) == 0, "query heads must be a multiple of KV heads");
  auto btc = bt.contiguous();
  auto lens = kvlen.contiguous();
  TORCH_CHECK(lens.numel() >= q.size(0), "paged_decode_attention: a kv length for every row");
  const int* lp = lens.data_ptr<int>();
  for (int64_t r = 0; r < q.size(0); ++r)  // a length sizes each row's score buffer
    TORCH_CHECK(lp[r] >= 0, "paged_decode_attention: kv length ", lp[r], " of row ", r);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const int64_t d = q.size(2);
  if (q.scalar_type() == at::kFloat) {
    if (d == 64 && paged_decode_f32_d64(q, kc, vc, btc, lens, out, rows, scale))
      return out;  // the AVX2 kernel (paged_attention_f32.cpp)
    if (d == 64)
      paged_decode<float, 64>(q, kc, vc, btc, lens, out, rows, scale);
    else if (d == 128)
      paged_decode<float, 128>(q, kc, vc, btc, lens, out, rows, scale);
    else
      paged_decode<float, 0>(q, kc, vc, btc, lens, out, rows, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
#ifdef PDSERVE_BF16_D64
    const int64_t g = q.size(1) / kc.size(0);
    if (d == 64 && g == 1)
      paged_decode_bf16_d64<1>(q, kc, vc, btc, lens, out, rows, scale);
    else if (d == 64 && g == 2)
      paged_decode_bf16_d64<2>(q, kc, vc, btc, lens, out, rows, scale);
    else if (d == 64 && g == 3)
      paged_decode_bf16_d64<3>(q, kc, vc, btc, lens, out, rows, scale);
    else if (d == 64 && g == 4)
      paged_decode_bf16_d64<4>(q, kc, vc, btc, lens, out, rows, scale);
    else if (d == 64)
      paged_decode<at::BFloat16, 64>(q, kc, vc, btc, lens, out, rows, scale);
#else
    if (d == 64) paged_decode<at::BFloat16, 64>(q, kc, vc, btc, lens, out, rows, scale);
#endif
    else if (d == 128)
      paged_decode<at::BFloat16, 128>(q, kc, vc, btc, lens, out, rows, scale);
    else
      paged_decode<at::BFloat16, 0>(q, kc, vc, btc, lens, out, rows, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace pdserve
