// Paged decode attention, bfloat16 with head_dim 64, its scores on the AMX tiles: the
// same task as paged_attention.cpp's AVX512-BF16 path (one task per (query row, KV head),
// float32 softmax and accumulation, one rounding to bf16), but a block of 16 keys is
// scored against all G query heads of its KV head with two TDPBF16PS: the K block as it
// lies in the cache is the A operand (16 keys x 32 bf16 pairs of head_dim), the query
// heads, pair-interleaved once per task, the B operand (32 pairs x G), so no horizontal
// sums. The AVX512 path spends ~14 instructions a key scoring G = 3 heads; here it is two
// tile loads and two tile products per 16 keys. The V pass stays on float32 FMAs (a bf16
// probability would round the softmax), but widens bf16 by shift and mask, 2 instructions
// per 32 elements instead of 4, and puts the lanes back in order once per task.
//
// Chosen against the AVX512 path by measurement where both run (engine/layers/
// decode_attention_choice.py); offered only where the CPU has AMX-BF16, the kernel was
// built for it, and the OS grants the tile state.

#include "cost_split.h"
#include "ops.h"
#include "paged_decode_common.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PDSERVE_AMX_DECODE 1
#endif

namespace pdserve {

#ifdef PDSERVE_AMX_DECODE
namespace {

// the tile state is off for a process until it asks (Linux 5.16+); oneDNN asks too, and
// asking twice is harmless
bool tiles_granted() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0 scores [16 keys x G], tmm1/2 the K block's two halves of head_dim [16 x 32 bf16],
// tmm3/4 the query heads' pairs 0-15 and 16-31 [16 pairs x G]
template <int G>
TileConfig score_tiles() {
  TileConfig c;
  for (int t = 0; t < 5; ++t) c.rows[t] = 16;
  c.colsb[0] = c.colsb[3] = c.colsb[4] = G * 4;
  c.colsb[1] = c.colsb[2] = 64;
  return c;
}

// blocks prefetched ahead within a row, and of the next row during the V pass. With the
// scores cheap the fetch must start earlier than the vector path's 2: 30 layers of 64 rows
// x 32-712 keys, AMX Xeon, 2 threads: 2 ahead 29.7 ms, 4 28.9, 8 27.8, 12-16 28.2-28.9;
// 8 of the next row instead of 4 no better
constexpr int64_t AHEAD = 8, NEXT_AHEAD = 4;

// scores key-major, sc[key * G + g]; 16 keys are G vectors, and lane l of the block's
// vector c belongs to head (16 c + l) % G, the same in every block. In place: scale, the
// maximum and exp per head, inv[g] = 1 / sum (the accumulators are scaled once at the end)
template <int G>
void exp_scores(float* sc, int64_t L, float scale, float* inv) {
  const int64_t n = L * G;
  __m512i head[G];
  __m512 mx[G], sum[G];
  for (int c = 0; c < G; ++c) {
    alignas(64) int32_t h[16];
    for (int l = 0; l < 16; ++l) h[l] = (16 * c + l) % G;
    head[c] = _mm512_load_si512(h);
    mx[c] = _mm512_set1_ps(-INFINITY);
    sum[c] = _mm512_setzero_ps();
  }
  const __m512 s16 = _mm512_set1_ps(scale);
  auto lanes = [&](int64_t f) -> __mmask16 {
    return n - f >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - f)) - 1);
  };
  for (int64_t f = 0; f < n; f += 16 * G)
    for (int c = 0; c < G && f + 16 * c < n; ++c) {
      const int64_t p = f + 16 * c;
      const __mmask16 k = lanes(p);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sc + p), s16);
      mx[c] = _mm512_mask_max_ps(mx[c], k, mx[c], x);
    }
  alignas(64) float m[16] = {};
  for (int g = 0; g < G; ++g) {
    float v = -INFINITY;
    for (int c = 0; c < G; ++c) {
      const __mmask16 mine = _mm512_cmpeq_epi32_mask(head[c], _mm512_set1_epi32(g));
      v = std::max(v, _mm512_mask_reduce_max_ps(mine, mx[c]));
    }
    m[g] = v;
  }
  const __m512 mv = _mm512_load_ps(m);
  __m512 shift[G];
  for (int c = 0; c < G; ++c) shift[c] = _mm512_permutexvar_ps(head[c], mv);
  for (int64_t f = 0; f < n; f += 16 * G)
    for (int c = 0; c < G && f + 16 * c < n; ++c) {
      const int64_t p = f + 16 * c;
      const __mmask16 k = lanes(p);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sc + p), s16);
      const __m512 e = exp_nonpos16(_mm512_sub_ps(x, shift[c]));
      _mm512_mask_storeu_ps(sc + p, k, e);
      sum[c] = _mm512_add_ps(sum[c], _mm512_maskz_mov_ps(k, e));
    }
  for (int g = 0; g < G; ++g) {
    float total = 0.f;
    for (int c = 0; c < G; ++c)
      total +=
          _mm512_mask_reduce_add_ps(_mm512_cmpeq_epi32_mask(head[c], _mm512_set1_epi32(g)), sum[c]);
    inv[g] = L > 0 ? 1.f / total : 0.f;  // no keys (a padded row): zeros
  }
}

template <int G>
void decode_amx(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                const at::Tensor& bt, const at::Tensor& kvlen, at::Tensor& out, int64_t rows,
                double scale_d) {
  constexpr int64_t D = 64;
  const int64_t N = q.size(0), Hq = q.size(1), qs = q.stride(0);
  const int64_t Hk = kc.size(0), NB = kc.size(1), BS = kc.size(2);
  const int64_t W = bt.size(1);
  const float scale = static_cast<float>(scale_d);
  const auto* qp = q.data_ptr<at::BFloat16>();
  const auto* kp = kc.data_ptr<at::BFloat16>();
  const auto* vp = vc.data_ptr<at::BFloat16>();
  const int* btp = bt.data_ptr<int>();
  const int* lp = kvlen.data_ptr<int>();
  auto* op = out.data_ptr<at::BFloat16>();
  auto len_of = [&](int64_t i) { return std::min<int64_t>(lp[i / Hk], W * BS); };
  auto block = [&](const at::BFloat16* cache, int64_t i, int64_t j) {
    return cache + ((i % Hk) * NB + btp[(i / Hk / rows) * W + j]) * BS * D;
  };
  run_ranges_by_cost(item_costs(lp, N * Hk, Hk, W * BS), [&](int64_t begin, int64_t end) {
    const TileConfig cfg = score_tiles<G>();
    _tile_loadconfig(&cfg);
    std::vector<float> sc;
    alignas(64) uint32_t qt[32 * G];  // the query heads' bf16 pairs, pair-major
    __m512 acc[4 * G];
    float inv[G];
    const EvenOdd64 v64;  // V rows widened as even and odd elements
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / Hk, h = i % Hk, L = len_of(i);
      const int64_t nblk = (L + BS - 1) / BS;
      sc.resize(nblk * BS * G);
      for (int g = 0; g < G; ++g) {
        const auto* w = reinterpret_cast<const uint32_t*>(qp + r * qs + (h * G + g) * D);
        for (int p = 0; p < 32; ++p) qt[p * G + g] = w[p];
      }
      _tile_loadd(3, qt, G * 4);
      _tile_loadd(4, qt + 16 * G, G * 4);
      for (int64_t j = 0; j < std::min(nblk, AHEAD); ++j) {
        prefetch_block(block(kp, i, j), BS * D);
        prefetch_block(block(vp, i, j), BS * D);
      }
      for (int64_t j = 0; j < nblk; ++j) {
        if (j + AHEAD < nblk) {
          prefetch_block(block(kp, i, j + AHEAD), BS * D);
          prefetch_block(block(vp, i, j + AHEAD), BS * D);
        }
        const at::BFloat16* kb = block(kp, i, j);
        for (int64_t t = 0; t < BS; t += 16) {  // rows past L score garbage, never read
          _tile_zero(0);
          _tile_loadd(1, kb + t * D, D * 2);
          _tile_loadd(2, kb + t * D + 32, D * 2);
          _tile_dpbf16ps(0, 1, 3);
          _tile_dpbf16ps(0, 2, 4);
          _tile_stored(0, sc.data() + (j * BS + t) * G, G * 4);
        }
      }
      exp_scores<G>(sc.data(), L, scale, inv);
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
        const float* w = sc.data() + j * BS * G;
        for (int64_t t = 0; t < cnt; ++t) {
          __m512 f[4];
          v64.widen(vb + t * D, f);
          for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(w[t * G + g]);
            for (int c = 0; c < 4; ++c) acc[4 * g + c] = _mm512_fmadd_ps(p, f[c], acc[4 * g + c]);
          }
        }
      }
      for (int g = 0; g < G; ++g) v64.store(op + (r * Hq + h * G + g) * D, acc + 4 * g, inv[g]);
    }
    // tiles released through torch's brgemm wrapper: it also forgets the tile
    // configuration it last loaded on this thread, which ours replaced
    at::native::cpublas::brgemm_release();
  });
}

}  // namespace
#endif

bool paged_amx_decode_available() {
#ifdef PDSERVE_AMX_DECODE
  return tiles_granted();
#else
  return false;
#endif
}

at::Tensor paged_decode_attention_amx(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt,
                                      at::Tensor kvlen, int64_t rows, double scale) {
  TORCH_CHECK(paged_amx_decode_available(),
              "paged_decode_attention_amx: no AMX-BF16 here (CPU, build or OS)");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 64 && q.stride(2) == 1 && q.stride(1) == 64 &&
                  kc.is_contiguous() && vc.is_contiguous(),
              "paged_decode_attention_amx: head_dim 64, q's heads and the caches contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kc.scalar_type() == at::kBFloat16 &&
                  vc.scalar_type() == at::kBFloat16,
              "paged_decode_attention_amx: bfloat16 only");
  TORCH_CHECK(kc.size(2) % 16 == 0, "paged_decode_attention_amx: block size a multiple of 16, got ",
              kc.size(2));
  TORCH_CHECK(bt.scalar_type() == at::kInt && kvlen.scalar_type() == at::kInt,
              "paged_decode_attention_amx: block tables and kv lengths must be int32");
  const int64_t g = q.size(1) / kc.size(0);
  TORCH_CHECK(q.size(1) % kc.size(0) == 0 && g >= 1 && g <= 4,
              "paged_decode_attention_amx: 1-4 query heads per KV head");
  auto btc = bt.contiguous();
  auto lens = kvlen.contiguous();
  TORCH_CHECK(lens.numel() >= q.size(0), "paged_decode_attention_amx: a kv length for every row");
  const int* lp = lens.data_ptr<int>();
  for (int64_t r = 0; r < q.size(0); ++r)  // a length sizes each row's score buffer
    TORCH_CHECK(lp[r] >= 0, "paged_decode_attention_amx: kv length ", lp[r], " of row ", r);
  auto out = at::empty({q.size(0), q.size(1), 64}, q.options());
#ifdef PDSERVE_AMX_DECODE
  if (g == 1) decode_amx<1>(q, kc, vc, btc, lens, out, rows, scale);
  if (g == 2) decode_amx<2>(q, kc, vc, btc, lens, out, rows, scale);
  if (g == 3) decode_amx<3>(q, kc, vc, btc, lens, out, rows, scale);
  if (g == 4) decode_amx<4>(q, kc, vc, btc, lens, out, rows, scale);
#endif
  return out;
}

}  // namespace pdserve
