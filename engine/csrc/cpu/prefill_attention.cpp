// Tiled bf16 prefill attention (head_dim 64, AVX512-BF16): 8 rows x the query heads of a KV
// head share each K/V chunk. Used by engine/layers/cpu_prefill_attention.py.

#include "ops.h"
#include "prefill_common.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pdserve {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PDSERVE_PREFILL_TILES 1

namespace {

constexpr int64_t D = 64, QT = 8, CH = 16;  // head_dim, rows a tile, keys a chunk

struct Task {
  int64_t seq, head, row0, rows, keys;
};

// K chunk [16 keys][64] -> kt[32 pairs] (lane k of pair p: key k's elements 2p, 2p+1);
// `valid` keys, the rest zeroed (a block's tail may hold anything)
inline void transpose_k(const uint16_t* k, int64_t valid, __m512i* kt) {
  alignas(64) uint32_t tmp[32][16];
  const uint32_t* src = reinterpret_cast<const uint32_t*>(k);
  for (int key = 0; key < 16; ++key)
    for (int p = 0; p < 32; ++p) tmp[p][key] = key < valid ? src[key * 32 + p] : 0u;
  for (int p = 0; p < 32; ++p) kt[p] = _mm512_load_si512(tmp[p]);
}

// V chunk [16 keys][64] -> vp[8 key pairs][4]: unpacklo/hi of keys 2j, 2j+1 (within 128-bit
// lanes: vp[j][0] holds d 0-3, 8-11, 16-19, 24-27 as pairs; [1] d 4-7, ...; [2], [3] the
// same for d 32-63); `valid` keys, the rest zeroed
inline void interleave_v(const uint16_t* v, int64_t valid, __m512i* vp) {
  for (int j = 0; j < 8; ++j) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
    if (2 * j < valid) {
      a0 = _mm512_loadu_si512(v + 2 * j * D);
      a1 = _mm512_loadu_si512(v + 2 * j * D + 32);
    }
    if (2 * j + 1 < valid) {
      b0 = _mm512_loadu_si512(v + (2 * j + 1) * D);
      b1 = _mm512_loadu_si512(v + (2 * j + 1) * D + 32);
    }
    vp[4 * j] = _mm512_unpacklo_epi16(a0, b0);
    vp[4 * j + 1] = _mm512_unpackhi_epi16(a0, b0);
    vp[4 * j + 2] = _mm512_unpacklo_epi16(a1, b1);
    vp[4 * j + 3] = _mm512_unpackhi_epi16(a1, b1);
  }
}

// accumulators in interleave_v's d order -> d 0-15 and 16-31 of that half
inline void unpermute(__m512 lo, __m512 hi, __m512* d0, __m512* d1) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  *d0 = _mm512_permutex2var_ps(lo, i0, hi);
  *d1 = _mm512_permutex2var_ps(lo, i1, hi);
}

struct Ctx : PrefillRows {
  // every sequence's K and V chunks, transposed / interleaved once: 32 vectors a chunk,
  // sequence s's chunk ch of head h at chunk index (base[s] + ch) * Hk + h
  const __m512i* kt;
  const __m512i* vp;
  const int64_t* base;
};

// the first n lanes (all 16 from n >= 16, none from n <= 0)
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? 0xffff : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// scores of NQ query vectors against one transposed chunk
template <int NQ>
inline void score_chunk(const uint16_t* const* qv, const __m512i* kt, float scale, float* s,
                        int64_t ld) {
  __m512 acc[NQ];
  for (int u = 0; u < NQ; ++u) acc[u] = _mm512_setzero_ps();
  for (int p = 0; p < 32; ++p) {
    const __m512i k = _mm512_load_si512(kt + p);
    for (int u = 0; u < NQ; ++u) {
      const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(qv[u] + 2 * p));
      acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)a, (__m512bh)k);
    }
  }
  for (int u = 0; u < NQ; ++u)
    _mm512_storeu_ps(s + u * ld, _mm512_mul_ps(acc[u], _mm512_set1_ps(scale)));
}

// P.V of NQ rows over `nch` chunks (accumulators in registers), scaled by 1/sum, stored
template <int NQ>
void pv_rows(const uint32_t* const* pp, const __m512i* vp, int64_t stride, int64_t nch,
             const float* inv, uint16_t* const* out) {
  __m512 acc[NQ][4];
  for (int u = 0; u < NQ; ++u)
    for (int c = 0; c < 4; ++c) acc[u][c] = _mm512_setzero_ps();
  for (int64_t ch = 0; ch < nch; ++ch) {
    const __m512i* v = vp + ch * stride;
    for (int j = 0; j < 8; ++j) {
      const __m512i v0 = _mm512_load_si512(v + 4 * j), v1 = _mm512_load_si512(v + 4 * j + 1);
      const __m512i v2 = _mm512_load_si512(v + 4 * j + 2), v3 = _mm512_load_si512(v + 4 * j + 3);
      for (int u = 0; u < NQ; ++u) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp[u][8 * ch + j]));
        acc[u][0] = _mm512_dpbf16_ps(acc[u][0], a, (__m512bh)v0);
        acc[u][1] = _mm512_dpbf16_ps(acc[u][1], a, (__m512bh)v1);
        acc[u][2] = _mm512_dpbf16_ps(acc[u][2], a, (__m512bh)v2);
        acc[u][3] = _mm512_dpbf16_ps(acc[u][3], a, (__m512bh)v3);
      }
    }
  }
  for (int u = 0; u < NQ; ++u) {
    const __m512 sc = _mm512_set1_ps(inv[u]);
    __m512 d[4];
    unpermute(acc[u][0], acc[u][1], &d[0], &d[1]);
    unpermute(acc[u][2], acc[u][3], &d[2], &d[3]);
    for (int q4 = 0; q4 < 4; ++q4)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[u] + 16 * q4),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(d[q4], sc)));
  }
}

void run_task(const Ctx& c, const Task& t, std::vector<float>& sbuf, std::vector<uint16_t>& pbuf) {
  const int64_t G = c.G, R = t.rows * G, nch = (t.keys + CH - 1) / CH, ld = nch * CH;
  const int64_t ctx = c.ctx[t.seq], first = c.qstart[t.seq] + t.row0;
  const int64_t stride = c.Hk * 32;  // vectors from one chunk to the next
  const __m512i* kt = c.kt + (c.base[t.seq] * c.Hk + t.head) * 32;
  const __m512i* vp = c.vp + (c.base[t.seq] * c.Hk + t.head) * 32;
  sbuf.resize(R * ld);
  pbuf.resize(R * ld);
  const uint16_t* qv[32];
  uint16_t* ov[32];
  for (int64_t j = 0; j < t.rows; ++j)
    for (int64_t g = 0; g < G; ++g) {
      qv[j * G + g] = c.q + (first + j) * c.qs + (t.head * G + g) * D;
      ov[j * G + g] = c.out + ((first + j) * c.Hq + t.head * G + g) * D;
    }
  for (int64_t ch = 0; ch < nch; ++ch) {
    int64_t r = 0;
    for (; r + 8 <= R; r += 8)
      score_chunk<8>(qv + r, kt + ch * stride, c.scale, sbuf.data() + r * ld + ch * CH, ld);
    for (; r + 4 <= R; r += 4)
      score_chunk<4>(qv + r, kt + ch * stride, c.scale, sbuf.data() + r * ld + ch * CH, ld);
    for (; r < R; ++r)
      score_chunk<1>(qv + r, kt + ch * stride, c.scale, sbuf.data() + r * ld + ch * CH, ld);
  }
  float inv[32];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t len = ctx + t.row0 + r / G + 1;  // causal: keys up to the row's own
    const float* sr = sbuf.data() + r * ld;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t k = 0; k < len; k += 16)
      mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, lanes(len - k), sr + k));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    uint16_t* p = pbuf.data() + r * ld;
    for (int64_t k = 0; k < ld; k += 16) {  // past the row's length: probability 0
      const __mmask16 in = lanes(len - k);
      const __m512 e = _mm512_maskz_mov_ps(
          in, exp_nonpos16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, sr + k), m)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + k), (__m256i)_mm512_cvtneps_pbh(e));
    }
    inv[r] = 1.f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t r0 = 0; r0 < R; r0 += 6) {
    const int64_t nq = std::min<int64_t>(6, R - r0);
    const int64_t keys = ctx + t.row0 + (r0 + nq - 1) / G + 1;  // the widest of these rows
    const int64_t n = (keys + CH - 1) / CH;
    const uint32_t* pp[6];
    for (int64_t u = 0; u < nq; ++u)
      pp[u] = reinterpret_cast<const uint32_t*>(pbuf.data() + (r0 + u) * ld);
    switch (nq) {
      case 6:
        pv_rows<6>(pp, vp, stride, n, inv + r0, ov + r0);
        break;
      case 5:
        pv_rows<5>(pp, vp, stride, n, inv + r0, ov + r0);
        break;
      case 4:
        pv_rows<4>(pp, vp, stride, n, inv + r0, ov + r0);
        break;
      case 3:
        pv_rows<3>(pp, vp, stride, n, inv + r0, ov + r0);
        break;
      case 2:
        pv_rows<2>(pp, vp, stride, n, inv + r0, ov + r0);
        break;
      default:
        pv_rows<1>(pp, vp, stride, n, inv + r0, ov + r0);
        break;
    }
  }
}

}  // namespace
#endif

bool prefill_attention_available() {
#ifdef PDSERVE_PREFILL_TILES
  return true;
#else
  return false;
#endif
}

// q [T, Hq, 64] bf16 (rows may be strided), caches [Hkv, blocks, block_size, 64], block
// tables [S, W] int32, query_start [S + 1] int64 (rows of each sequence in q), context
// [S] int32 (keys cached before its first row) -> out [T, Hq, 64]
at::Tensor prefill_attention(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt,
                             at::Tensor qstart, at::Tensor context, double scale) {
  TORCH_CHECK(prefill_attention_available(), "prefill_attention: built without AVX512-BF16");
  check_prefill_args("prefill_attention", q, kc, vc, bt, qstart, context);
  TORCH_CHECK(kc.size(2) % 16 == 0, "prefill_attention: blocks of a multiple of 16 keys");
  const int64_t Hq = q.size(1), Hk = kc.size(0), S = bt.size(0);
  auto out = at::empty({q.size(0), Hq, 64}, q.options());
#ifdef PDSERVE_PREFILL_TILES
  const int64_t* qs = qstart.data_ptr<int64_t>();
  const int* cx = context.data_ptr<int>();
  const int64_t BS = kc.size(2), W = bt.size(1);
  TORCH_CHECK(qs[S] <= q.size(0), "prefill_attention: query_start past q's rows");
  std::vector<Task> tasks;
  std::vector<int64_t> cost{0};
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qs[s + 1] - qs[s];
    TORCH_CHECK(n >= 0 && cx[s] >= 0 && cx[s] + n <= W * BS,
                "prefill_attention: a sequence's keys exceed its block table");
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t r0 = 0; r0 < n; r0 += QT) {
        const int64_t rows = std::min(QT, n - r0), keys = cx[s] + r0 + rows;
        tasks.push_back({s, h, r0, rows, keys});
        cost.push_back(cost.back() + rows * keys);
      }
  }
  // every sequence's K and V chunks, transposed / interleaved once for all its tiles
  std::vector<int64_t> base(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) base[s + 1] = base[s] + (cx[s] + qs[s + 1] - qs[s] + 15) / 16;
  std::vector<__m512i> kt(base[S] * Hk * 32), vt(base[S] * Hk * 32);
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  const int* btp = bt.data_ptr<int>();
  const int64_t NB = kc.size(1);
  at::parallel_for(0, base[S] * Hk, 16, [&](int64_t b, int64_t e) {
    int64_t s = 0;
    for (int64_t i = b; i < e; ++i) {
      const int64_t chunk = i / Hk, h = i % Hk;
      while (base[s + 1] <= chunk) ++s;
      const int64_t key0 = (chunk - base[s]) * 16, keys = cx[s] + qs[s + 1] - qs[s];
      const int64_t blk = btp[s * W + key0 / BS], off = key0 % BS;
      const int64_t at = ((h * NB + blk) * BS + off) * D;
      const int64_t valid = std::min<int64_t>(16, keys - key0);
      transpose_k(kp + at, valid, kt.data() + i * 32);
      interleave_v(vp + at, valid, vt.data() + i * 32);
    }
  });
  const Ctx c{prefill_rows(q, kc, qstart, context, scale, out), kt.data(), vt.data(), base.data()};
  run_by_cost(cost, [&] {
    return [&c, &tasks, sbuf = std::vector<float>(), pbuf = std::vector<uint16_t>()](
               int64_t i) mutable { run_task(c, tasks[i], sbuf, pbuf); };
  });
#endif
  return out;
}

}  // namespace pdserve
