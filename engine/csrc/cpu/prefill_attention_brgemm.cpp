// bf16 prefill attention (head_dim 64) on oneDNN's batch-reduce GEMM micro-kernel, as torch
// exposes it (at::native::cpublas::brgemm): AMX tiles where the CPU has them, AVX512-BF16
// dot products where it does not. Used by engine/layers/cpu_prefill_attention.py.
//
// Why a second prefill kernel: torch's flash SDPA runs bf16 q.k^T and p.v through one
// cpublas::gemm call per 32-64 rows and head (~200-360 GFLOP/s on an AMX Xeon for SmolLM2's
// heads), and the tile kernel (prefill_attention.cpp) spends VDPBF16PS where AMX tiles are
// there. Here a task is one sequence, one KV head and a tile of up to 64 consecutive rows:
// the G query heads of those rows form the M rows of one GEMM against each block of 256 keys.
//
// - Every sequence's K and V are packed once per step into the micro-kernel's VNNI layout
//   (pairs of the reduction dimension side by side), 256 keys a block, zero past the end.
// - Per key block: scores = one brgemm; softmax in float32 with a running maximum
//   (online), probabilities rounded to bf16 once; out += probabilities . V as a second
//   brgemm accumulating into float32; the rows that cannot see any key of the block (the
//   causal triangle) are left out of both GEMMs, and so are the block's keys past the
//   last row's (in whole 32s: a zero probability adds nothing to the sum).
// - Scratch and packed blocks on 64-byte boundaries, 256-key blocks, the exp in base 2:
//   a mixed 2,048-token step's 30 calls (7 prompts of 32-512 tokens, AMX Xeon, 2
//   threads) 84.7 -> 46 ms; the alignment alone 75 -> 55 (docs/perf/HISTORY.md).
// - A row's result depends on its query, its keys and its length only: blocks start at key
//   0 of the sequence, whatever the tile, the chunk or the batch, so chunked prefill and
//   prefix-cache hits give the same bits. They are not the tile kernel's or SDPA's bits.

#include "ops.h"
#include "prefill_common.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace pdserve {

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PDSERVE_PREFILL_BRGEMM 1

namespace {

constexpr int64_t D = 64, BN = 256, ROWS = 64;  // head_dim, keys a block, rows a tile
constexpr float LOG2E = 1.44269504088896341f;

// n elements of T on a 64-byte boundary, uninitialised: the micro-kernel's tile rows
// (64 bytes) then never straddle two cache lines. std::vector's 16-byte alignment made
// the same call 60 or 81 ms a step from one process to the next, as the heap placed it.
template <typename T>
class Buf64 {
 public:
  explicit Buf64(size_t n)
      : p_(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))) {
    TORCH_CHECK(p_ != nullptr, "prefill_attention_brgemm: out of memory for scratch");
  }
  ~Buf64() { std::free(p_); }
  Buf64(const Buf64&) = delete;
  Buf64& operator=(const Buf64&) = delete;
  Buf64(Buf64&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  T* data() const { return p_; }
  T& operator[](size_t i) const { return p_[i]; }

 private:
  T* p_;
};

struct Task {
  int64_t seq, head, row0, rows, keys;
};

// 16 floats -> 16 bfloat16, rounded to nearest even (NaN kept)
inline __m256i to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

// 2^t for t <= 0 on 16 lanes (vec.h's exp2_16, t clamped where the result is 0 anyway).
// The softmax's exp(s * scale - m) is 2^(s * scale log2 e - m log2 e), one fmadd with the
// constants folded: 10 operations a vector where exp_nonpos16 after its own fmadd takes
// 18, and the softmax is most of this kernel.
inline __m512 exp2_nonpos16(__m512 t) {
  return exp2_16(_mm512_max_ps(t, _mm512_set1_ps(-160.f)));  // 2^-160 is 0 in float32
}

// K block [BN keys][64] -> [32 pairs][BN keys][2]: as uint32, a transpose
void pack_k(const uint16_t* const* rows, int64_t valid, uint32_t* out) {
  for (int64_t key = 0; key < BN; ++key) {
    if (key < valid) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(rows[key]);
      for (int p = 0; p < 32; ++p) out[p * BN + key] = src[p];
    } else {
      for (int p = 0; p < 32; ++p) out[p * BN + key] = 0u;
    }
  }
}

// V block [BN keys][64] -> [BN / 2 key pairs][64][2]: keys 2j and 2j+1 interleaved
void pack_v(const uint16_t* const* rows, int64_t valid, uint16_t* out) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < BN / 2; ++j) {
    uint16_t* o = out + j * 2 * D;
    for (int half = 0; half < 2; ++half) {
      __m512i a = _mm512_setzero_si512(), b = a;
      if (2 * j < valid) a = _mm512_loadu_si512(rows[2 * j] + 32 * half);
      if (2 * j + 1 < valid) b = _mm512_loadu_si512(rows[2 * j + 1] + 32 * half);
      _mm512_storeu_si512(o + 64 * half, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(o + 64 * half + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

struct Ctx : PrefillRows {
  // packed blocks: sequence s's key block kb of head h at (base[s] + kb) * Hk + h
  const uint32_t* kpack;
  const uint16_t* vpack;
  const int64_t* base;
};

struct Scratch {
  Buf64<uint16_t> qa, p;
  Buf64<float> s, acc, mx, sum;
  Scratch()
      : qa(4 * ROWS * D),
        p(4 * ROWS * BN),
        s(4 * ROWS * BN),
        acc(4 * ROWS * D),
        mx(4 * ROWS),
        sum(4 * ROWS) {}
};

void run_task(const Ctx& c, const Task& t, Scratch& w) {
  using at::BFloat16;
  const int64_t G = c.G, M = t.rows * G, ctx = c.ctx[t.seq];
  const int64_t first = c.qstart[t.seq] + t.row0;
  for (int64_t j = 0; j < t.rows; ++j)
    for (int64_t g = 0; g < G; ++g)
      std::memcpy(w.qa.data() + (j * G + g) * D, c.q + (first + j) * c.qs + (t.head * G + g) * D,
                  D * sizeof(uint16_t));
  std::fill_n(w.acc.data(), M * D, 0.f);
  std::fill_n(w.mx.data(), M, -INFINITY);
  std::fill_n(w.sum.data(), M, 0.f);
  const __m512 scale2 = _mm512_set1_ps(c.scale * LOG2E);  // scores to base-2 exponents
  const int64_t nkb = (t.keys + BN - 1) / BN;
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * BN;
    // rows before r0 see no key of this block (row j sees ctx + row0 + j + 1 keys)
    const int64_t j0 = std::max<int64_t>(0, k0 - ctx - t.row0), r0 = j0 * G, Mb = M - r0;
    const int64_t blk = (c.base[t.seq] + kb) * c.Hk + t.head;
    // the keys of this block any row of the tile sees, in whole 32s: the scores and the
    // probabilities past them are never computed (the last rows' keys are the most)
    const int64_t nc = (std::min<int64_t>(BN, ctx + t.row0 + t.rows - k0) + 31) / 32 * 32;
    at::native::cpublas::brgemm(
        Mb, nc, D, D, BN, BN, false, reinterpret_cast<const BFloat16*>(w.qa.data() + r0 * D),
        reinterpret_cast<const BFloat16*>(c.kpack + blk * 32 * BN), w.s.data() + r0 * BN);
    for (int64_t r = r0; r < M; ++r) {
      const int64_t valid = std::min<int64_t>(BN, ctx + t.row0 + r / G + 1 - k0);
      const int64_t nv = (valid + 15) / 16;  // vectors holding a visible key
      const float* sr = w.s.data() + r * BN;
      __m512 mv = _mm512_set1_ps(-INFINITY);
      for (int64_t v = 0; v < nv; ++v) {
        const int64_t left = valid - 16 * v;
        const __mmask16 in = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        mv = _mm512_mask_max_ps(mv, in, mv, _mm512_loadu_ps(sr + 16 * v));
      }
      // the scale is positive, so the scaled maximum is the maximum scaled
      const float old = w.mx[r], m = std::max(old, _mm512_reduce_max_ps(mv) * c.scale);
      const float alpha = std::exp(old - m);  // 0 on the row's first block
      const __m512 neg_m = _mm512_set1_ps(-m * LOG2E);
      __m512 acc = _mm512_setzero_ps();
      uint16_t* pr = w.p.data() + r * BN;
      for (int64_t v = 0; v < nv; ++v) {
        const int64_t left = valid - 16 * v;
        const __mmask16 in = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __m512 e = _mm512_maskz_mov_ps(
            in, exp2_nonpos16(_mm512_fmadd_ps(_mm512_loadu_ps(sr + 16 * v), scale2, neg_m)));
        acc = _mm512_add_ps(acc, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * v), to_bf16(e));
      }
      for (int64_t v = nv; v < nc / 16; ++v)  // keys past the row's own: probability 0
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * v), _mm256_setzero_si256());
      w.sum[r] = w.sum[r] * alpha + _mm512_reduce_add_ps(acc);
      w.mx[r] = m;
      if (alpha != 1.f) {
        float* ar = w.acc.data() + r * D;
        const __m512 a = _mm512_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(ar + d, _mm512_mul_ps(_mm512_loadu_ps(ar + d), a));
      }
    }
    at::native::cpublas::brgemm(
        Mb, D, nc, BN, D, D, true, reinterpret_cast<const BFloat16*>(w.p.data() + r0 * BN),
        reinterpret_cast<const BFloat16*>(c.vpack + blk * BN * D), w.acc.data() + r0 * D);
  }
  for (int64_t r = 0; r < M; ++r) {
    const int64_t j = r / G, g = r % G;
    const __m512 inv = _mm512_set1_ps(1.f / w.sum[r]);
    uint16_t* o = c.out + ((first + j) * c.Hq + t.head * G + g) * D;
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                          to_bf16(_mm512_mul_ps(_mm512_loadu_ps(w.acc.data() + r * D + d), inv)));
  }
}

// whether the micro-kernel takes bf16 in the VNNI layout here and computes what we pack for
// it: a 16 x 32 x 32 product against a plain loop (it throws where oneDNN lacks the ukernel)
bool self_test() {
  try {
    std::vector<uint16_t> a(16 * 32), b(32 * 32);
    std::vector<float> fa(16 * 32), fb(32 * 32), c(16 * 32);
    for (int i = 0; i < 16 * 32; ++i) fa[i] = static_cast<float>((i * 7) % 13 - 6);
    for (int i = 0; i < 32 * 32; ++i) fb[i] = static_cast<float>((i * 5) % 11 - 5);
    for (int i = 0; i < 16 * 32; ++i) a[i] = float_to_bf16(fa[i]);
    for (int k = 0; k < 32; ++k)  // b[k][n] -> vnni [k / 2][n][k % 2]
      for (int n = 0; n < 32; ++n)
        b[((k / 2) * 32 + n) * 2 + k % 2] = float_to_bf16(fb[k * 32 + n]);
    at::native::cpublas::brgemm(16, 32, 32, 32, 32, 32, false,
                                reinterpret_cast<const at::BFloat16*>(a.data()),
                                reinterpret_cast<const at::BFloat16*>(b.data()), c.data());
    at::native::cpublas::brgemm_release();
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 32; ++n) {
        float ref = 0.f;
        for (int k = 0; k < 32; ++k) ref += fa[m * 32 + k] * fb[k * 32 + n];
        if (c[m * 32 + n] != ref) return false;
      }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace
#endif

bool prefill_attention_brgemm_available() {
#ifdef PDSERVE_PREFILL_BRGEMM
  static const bool ok = self_test();
  return ok;
#else
  return false;
#endif
}

// the arguments and result of prefill_attention (prefill_attention.cpp)
at::Tensor prefill_attention_brgemm(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt,
                                    at::Tensor qstart, at::Tensor context, double scale) {
  TORCH_CHECK(prefill_attention_brgemm_available(),
              "prefill_attention_brgemm: oneDNN's bf16 brgemm micro-kernel is not usable here");
  check_prefill_args("prefill_attention_brgemm", q, kc, vc, bt, qstart, context);
  const int64_t Hq = q.size(1), Hk = kc.size(0), S = bt.size(0);
  auto out = at::empty({q.size(0), Hq, 64}, q.options());
#ifdef PDSERVE_PREFILL_BRGEMM
  const int64_t* qs = qstart.data_ptr<int64_t>();
  const int* cx = context.data_ptr<int>();
  const int64_t BS = kc.size(2), W = bt.size(1), NB = kc.size(1);
  TORCH_CHECK(qs[S] <= q.size(0), "prefill_attention_brgemm: query_start past q's rows");
  std::vector<Task> tasks;
  std::vector<int64_t> cost{0};
  std::vector<int64_t> base(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qs[s + 1] - qs[s];
    TORCH_CHECK(n >= 0 && cx[s] >= 0 && cx[s] + n <= W * BS,
                "prefill_attention_brgemm: a sequence's keys exceed its block table");
    base[s + 1] = base[s] + (cx[s] + n + BN - 1) / BN;
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t r0 = 0; r0 < n; r0 += ROWS) {
        const int64_t rows = std::min(ROWS, n - r0), keys = cx[s] + r0 + rows;
        tasks.push_back({s, h, r0, rows, keys});
        cost.push_back(cost.back() + rows * keys + 64 * rows);
      }
  }
  Buf64<uint32_t> kpack(base[S] * Hk * 32 * BN);
  Buf64<uint16_t> vpack(base[S] * Hk * BN * D);
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  const int* btp = bt.data_ptr<int>();
  at::parallel_for(0, base[S] * Hk, 4, [&](int64_t b, int64_t e) {
    int64_t s = 0;
    const uint16_t* krow[BN];
    const uint16_t* vrow[BN];
    for (int64_t i = b; i < e; ++i) {
      const int64_t block = i / Hk, h = i % Hk;
      while (base[s + 1] <= block) ++s;
      const int64_t key0 = (block - base[s]) * BN, keys = cx[s] + qs[s + 1] - qs[s];
      const int64_t valid = std::min<int64_t>(BN, keys - key0);
      for (int64_t k = 0; k < valid; ++k) {
        const int64_t key = key0 + k;
        const int64_t at = ((h * NB + btp[s * W + key / BS]) * BS + key % BS) * D;
        krow[k] = kp + at;
        vrow[k] = vp + at;
      }
      pack_k(krow, valid, kpack.data() + i * 32 * BN);
      pack_v(vrow, valid, vpack.data() + i * BN * D);
    }
  });
  const Ctx c{prefill_rows(q, kc, qstart, context, scale, out), kpack.data(), vpack.data(),
              base.data()};
  struct Worker {  // a thread's scratch; the AMX tiles released when its tasks are done
    const Ctx& c;
    const std::vector<Task>& tasks;
    Scratch w;
    void operator()(int64_t i) { run_task(c, tasks[i], w); }
    ~Worker() { at::native::cpublas::brgemm_release(); }
  };
  run_by_cost(cost, [&] { return Worker{c, tasks, Scratch()}; });
#endif
  return out;
}

}  // namespace pdserve
