// Paged decode attention in float32 with head_dim 64 and 1-4 query heads a KV head, on AVX2
// with FMA (x86-64-v3 and every CPU above it). Float32 is the dtype of the exactness runs
// and the one `--dtype auto` serves in on a CPU without native bf16 (an AVX2-only EPYC), so
// there a decode step's attention is a stream of float32 K/V: 1.1 GB a step at 64 rows of
// ~400 keys on SmolLM2. The generic loop (paged_attention.cpp) read it at 10-13 GB/s, about
// half of what a plain read gets on the same machine: it copied every K and V row before
// using it, reduced each score on its own, prefetched only its own next blocks and took the
// softmax one element at a time. Here a K row is scored against each query head straight
// from the cache, four keys' sums reduced together; the K pass prefetches the V blocks too,
// and the V pass the next item's first blocks; exp and the sums run on 8 lanes, and the
// probabilities are normalised once, on the output. Called from paged_decode_attention.

#include "cost_split.h"
#include "ops.h"
#include "paged_decode_common.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace pdserve {

#if defined(__AVX2__) && defined(__FMA__)
namespace {

constexpr int64_t D = 64;
constexpr int64_t AHEAD = 2;       // blocks of this item prefetched ahead (K and V)
constexpr int64_t NEXT_AHEAD = 4;  // blocks of the next item prefetched in the V pass

// the totals of four 8-lane vectors: two rounds of pairwise adds, then the two 128-bit lanes
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// 8 partial sums of q . k over 64 floats, in two chains (an FMA's latency covered)
inline __m256 dot64(const float* q, const float* k) {
  __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
  __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(k + 8));
  for (int c = 16; c < D; c += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), _mm256_loadu_ps(k + c + 8), s1);
  }
  return _mm256_add_ps(s0, s1);
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// one query head's L scores -> exp(score - max) in place; returns 1 / their sum (0 for none)
inline float exp_row(float* s, int64_t L) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 8 <= L; p += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + p));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = *std::max_element(lanes, lanes + 8);
  for (; p < L; ++p) m = std::max(m, s[p]);
  const __m256 m8 = _mm256_set1_ps(m);
  __m256 sum8 = _mm256_setzero_ps();
  for (p = 0; p + 8 <= L; p += 8) {
    const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(s + p), m8));
    _mm256_storeu_ps(s + p, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; p < L; ++p) {
    s[p] = exp_nonpos(s[p] - m);
    sum += s[p];
  }
  return L > 0 ? 1.f / sum : 0.f;
}

// G query heads a KV head; the V pass keeps G x 64 accumulators in registers in PARTS
// slices of the head dim (at most 12 of AVX2's 16 registers), each block's V rows read
// once a slice while the 4 KB block is in L1
template <int G>
void paged_f32_d64(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                   const at::Tensor& bt, const at::Tensor& kvlen, at::Tensor& out, int64_t rows,
                   double scale_d) {
  constexpr int PARTS = G * 8 <= 12 ? 1 : (G * 4 <= 12 ? 2 : 4);
  constexpr int CP = 8 / PARTS;  // 8-float vectors of a slice
  const int64_t N = q.size(0), Hq = q.size(1), qs = q.stride(0);
  const int64_t Hk = kc.size(0), NB = kc.size(1), BS = kc.size(2);
  const int64_t W = bt.size(1);
  const float scale = static_cast<float>(scale_d);
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int* btp = bt.data_ptr<int>();
  const int* lp = kvlen.data_ptr<int>();
  float* op = out.data_ptr<float>();
  // item i = (row i / Hk, KV head i % Hk); never read past the table
  auto len_of = [&](int64_t i) { return std::min<int64_t>(lp[i / Hk], W * BS); };
  auto block = [&](const float* cache, int64_t i, int64_t j) {
    return cache + ((i % Hk) * NB + btp[(i / Hk / rows) * W + j]) * BS * D;
  };
  run_ranges_by_cost(item_costs(lp, N * Hk, Hk, W * BS), [&](int64_t begin, int64_t end) {
    std::vector<float> sc;
    __m256 acc[G * 8];
    float inv[G];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / Hk, h = i % Hk;
      const int64_t L = len_of(i);
      const int64_t nblk = (L + BS - 1) / BS;
      sc.resize(G * L);
      const float* qh = qp + r * qs + h * G * D;
      for (int64_t j = 0; j < std::min(nblk, AHEAD); ++j) {
        prefetch_block(block(kp, i, j), BS * D);
        prefetch_block(block(vp, i, j), BS * D);
      }
      for (int64_t j = 0; j < nblk; ++j) {
        const float* kb = block(kp, i, j);
        const int64_t cnt = std::min(BS, L - j * BS);
        if (j + AHEAD < nblk) {
          prefetch_block(block(kp, i, j + AHEAD), BS * D);
          prefetch_block(block(vp, i, j + AHEAD), BS * D);
        }
        float* sj = sc.data() + j * BS;
        int64_t t = 0;
        for (; t + 4 <= cnt; t += 4)  // four keys: their four sums reduced together
          for (int g = 0; g < G; ++g) {
            const float* qg = qh + g * D;
            const __m128 s = hsum4(dot64(qg, kb + t * D), dot64(qg, kb + (t + 1) * D),
                                   dot64(qg, kb + (t + 2) * D), dot64(qg, kb + (t + 3) * D));
            _mm_storeu_ps(sj + g * L + t, _mm_mul_ps(s, _mm_set1_ps(scale)));
          }
        for (; t < cnt; ++t)
          for (int g = 0; g < G; ++g) sj[g * L + t] = hsum(dot64(qh + g * D, kb + t * D)) * scale;
      }
      for (int g = 0; g < G; ++g) inv[g] = exp_row(sc.data() + g * L, L);
      const int64_t next_blocks =
          i + 1 < end ? std::min(NEXT_AHEAD, (len_of(i + 1) + BS - 1) / BS) : 0;
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int64_t j = 0; j < nblk; ++j) {
        const float* vb = block(vp, i, j);
        const int64_t cnt = std::min(BS, L - j * BS);
        if (j < next_blocks) {
          prefetch_block(block(kp, i + 1, j), BS * D);
          prefetch_block(block(vp, i + 1, j), BS * D);
        }
        const float* pj = sc.data() + j * BS;
        for (int part = 0; part < PARTS; ++part) {
          __m256 a[G * CP];
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < CP; ++c) a[g * CP + c] = acc[g * 8 + part * CP + c];
          for (int64_t t = 0; t < cnt; ++t) {
            const float* vr = vb + t * D + part * CP * 8;
            for (int g = 0; g < G; ++g) {
              const __m256 w = _mm256_broadcast_ss(pj + g * L + t);
              for (int c = 0; c < CP; ++c)
                a[g * CP + c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), a[g * CP + c]);
            }
          }
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < CP; ++c) acc[g * 8 + part * CP + c] = a[g * CP + c];
        }
      }
      for (int g = 0; g < G; ++g) {
        float* o = op + (r * Hq + h * G + g) * D;
        const __m256 iv = _mm256_set1_ps(inv[g]);
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[g * 8 + c], iv));
      }
    }
  });
}

}  // namespace

bool paged_decode_f32_d64(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                          const at::Tensor& bt, const at::Tensor& kvlen, at::Tensor& out,
                          int64_t rows, double scale) {
  if (q.size(2) != D) return false;
  switch (q.size(1) / kc.size(0)) {
    case 1:
      paged_f32_d64<1>(q, kc, vc, bt, kvlen, out, rows, scale);
      return true;
    case 2:
      paged_f32_d64<2>(q, kc, vc, bt, kvlen, out, rows, scale);
      return true;
    case 3:
      paged_f32_d64<3>(q, kc, vc, bt, kvlen, out, rows, scale);
      return true;
    case 4:
      paged_f32_d64<4>(q, kc, vc, bt, kvlen, out, rows, scale);
      return true;
    default:
      return false;
  }
}
#else
bool paged_decode_f32_d64(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, at::Tensor&, int64_t, double) {
  return false;
}
#endif

}  // namespace pdserve
