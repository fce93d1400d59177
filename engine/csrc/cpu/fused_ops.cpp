// Fused decoder ops on CPU: rotary in place in the qkv rows, K/V cache writes, residual add
// + RMSNorm in bf16, and argmax over logits rows. Used by engine/layers/cpu_fused_ops.py
// and, through ops.h, by decode_layers.cpp. Built with -ffp-contract=off: its float32
// arithmetic must round as torch's separate ops do.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace pdserve {

namespace {

// A call over at most this many rows (a small decode batch) runs inline on the calling
// thread; at::parallel_for splits longer ones over torch's threads.
constexpr int64_t PAR_ROWS = 8;

struct F32 {
  using T = float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
  static inline float round(float v) { return v; }
};

struct BF16 {
  using T = uint16_t;
  static inline float load(uint16_t v) { return bf16_to_float(v); }
  static inline uint16_t store(float v) { return float_to_bf16(v); }
  static inline float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

template <class E>
void rope_impl(at::Tensor& qkv, const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin,
               int64_t heads, int64_t D) {
  using T = typename E::T;
  T* base = reinterpret_cast<T*>(qkv.data_ptr());
  const int64_t rows = qkv.size(0), stride = qkv.stride(0), half = D / 2;
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* ct = cos.data_ptr<float>();
  const float* st = sin.data_ptr<float>();
  at::parallel_for(0, rows, PAR_ROWS, [&](int64_t begin, int64_t end) {
    float x[1024], c[1024], s[1024];
    for (int64_t t = begin; t < end; ++t) {
      const float* cr = ct + p[t] * D;
      const float* sr = st + p[t] * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) {
        c[i] = E::round(cr[i]);
        s[i] = E::round(sr[i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = base + t * stride + h * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) x[i] = E::load(xh[i]);
#pragma omp simd
        for (int64_t i = 0; i < half; ++i)
          xh[i] = E::store(E::round(x[i] * c[i]) + E::round(x[i + half] * s[i]));
#pragma omp simd
        for (int64_t i = half; i < D; ++i)
          xh[i] = E::store(E::round(x[i] * c[i]) + E::round(x[i - half] * s[i]));
      }
    }
  });
}

void add_rms_norm_bf16(const at::Tensor& x, const at::Tensor* res, const at::Tensor& w,
                       at::Tensor& out, at::Tensor& sum, double eps_d) {
  using E = BF16;
  using T = E::T;
  const int64_t rows = x.size(0), H = x.size(1);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* rp = res ? reinterpret_cast<const T*>(res->data_ptr()) : nullptr;
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  T* sp = reinterpret_cast<T*>(sum.data_ptr());
  const float eps = static_cast<float>(eps_d);
  at::parallel_for(0, rows, PAR_ROWS, [&](int64_t begin, int64_t end) {
    float v[8192];
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = xp + t * H;
      float ss = 0.f;
      if (rp) {
        const T* rr = rp + t * H;
        T* sr = sp + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) {
          const T s = E::store(E::load(rr[i]) + E::load(xr[i]));
          sr[i] = s;
          v[i] = E::load(s);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) v[i] = E::load(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += v[i] * v[i];
      const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = op + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = E::store(E::load(wp[i]) * E::round(v[i] * rstd));
    }
  });
}

bool is_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16;
}

void check_cpu_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": a CPU tensor is required");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              ": float32 or bfloat16 only");
}

}  // namespace

// qkv [T, >= heads*D], last dim contiguous; its first `heads` heads rotated in place
void rope_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t heads,
           int64_t D) {
  check_cpu_float(qkv, "rope_");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= heads * D,
              "rope_: qkv must be [T, >= heads*head_dim] with a contiguous last dim");
  TORCH_CHECK(D % 2 == 0 && D <= 1024, "rope_: head_dim must be even and <= 1024");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D,
              "rope_: cos/sin must be contiguous float32 [max_position, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.size(0) == qkv.size(0),
              "rope_: positions must be int64 [T]");
  const int64_t* p = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < cos.size(0), "rope_: a position is outside the rotary table");
  if (is_bf16(qkv))
    rope_impl<BF16>(qkv, positions, cos, sin, heads, D);
  else
    rope_impl<F32>(qkv, positions, cos, sin, heads, D);
}

// k, v [T, Hk, D] (last dim contiguous); caches [Hk, blocks, block_size, D]
void write_kv(at::Tensor k, at::Tensor v, at::Tensor kc, at::Tensor vc, at::Tensor slots) {
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 4 && kc.sizes() == vc.sizes(),
              "write_kv: caches must be contiguous 4-D, alike");
  TORCH_CHECK(k.scalar_type() == kc.scalar_type() && v.scalar_type() == kc.scalar_type(),
              "write_kv: k/v and the cache must share a dtype");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.size(1) == kc.size(0) && k.size(2) == kc.size(3),
              "write_kv: k/v must be [T, kv_heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(
      slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == k.size(0),
      "write_kv: slot_mapping must be int64 [T]");
  const int64_t T = k.size(0), Hk = k.size(1), D = k.size(2);
  const int64_t nslots = kc.size(1) * kc.size(2);
  const int64_t es = kc.element_size();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < nslots, "write_kv: slot ", sl[t], " outside the cache");
  char* kb = static_cast<char*>(kc.data_ptr());
  char* vb = static_cast<char*>(vc.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, T, PAR_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < Hk; ++h) {
        const int64_t dst = ((h * nslots) + sl[t]) * D * es;
        std::memcpy(kb + dst, ks + (t * k.stride(0) + h * k.stride(1)) * es, D * es);
        std::memcpy(vb + dst, vs + (t * v.stride(0) + h * v.stride(1)) * es, D * es);
      }
  });
}

// (RMSNorm(residual + x) * weight, residual + x); residual may be None (then just x)
std::vector<at::Tensor> add_rms_norm(at::Tensor x, std::optional<at::Tensor> residual,
                                     at::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && is_bf16(x),
              "add_rms_norm: a CPU bfloat16 tensor is "
              "required (float32 keeps torch's norm, bit-equal to HF's)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) <= 8192,
              "add_rms_norm: x must be contiguous [T, hidden <= 8192]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "add_rms_norm: weight must match x");
  const at::Tensor* res = nullptr;
  at::Tensor sum = x;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "add_rms_norm: residual must match x");
    res = &residual.value();
    sum = at::empty_like(x);
  }
  at::Tensor out = at::empty_like(x);
  add_rms_norm_bf16(x, res, weight, out, sum, eps);
  return {out, sum};
}

namespace {

// torch.argmax's answer for one row: the first index of the maximum, a NaN counting as
// greater than any number (the first NaN wins)
template <typename T, typename L>
int64_t argmax_scalar(const T* x, int64_t n, L load) {
  int64_t best = 0;
  float m = load(x[0]);
  if (std::isnan(m)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = load(x[i]);
    if (std::isnan(v)) return i;
    if (v > m) {
      m = v;
      best = i;
    }
  }
  return best;
}

// the elements past the last full vector, after the lanes gave maximum m at index res
template <typename T, typename L>
int64_t argmax_tail(const T* x, int64_t n, L load, int64_t i, float m, int64_t res) {
  for (; i < n; ++i) {
    const float v = load(x[i]);
    if (std::isnan(v)) return argmax_scalar(x, n, load);
    if (v > m) {
      m = v;
      res = i;
    }
  }
  return res;
}

#ifdef __AVX512F__
inline __m512 load16(const float* x) {
  return _mm512_loadu_ps(x);
}

// 16 bf16 values widened to float32 (exact: a bf16 is a float32's upper half)
inline __m512 load16(const uint16_t* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__)
inline __m256 load8(const float* x) {
  return _mm256_loadu_ps(x);
}

// 8 bf16 values widened to float32
inline __m256 load8(const uint16_t* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// float32 or bf16 rows (bf16 read as it is: widening it first cost more than the search)
template <typename T, typename L>
int64_t argmax_row(const T* x, int64_t n, L load) {
#ifdef __AVX512F__
  if (n >= 32) {
    // 16 lanes, each keeping the first index of its own maximum (strictly greater
    // replaces); then the smallest index among the lanes holding the overall maximum
    __m512 best = load16(x);
    __m512i bidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = bidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = load16(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, gt, v);
      bidx = _mm512_mask_mov_epi32(bidx, gt, idx);
    }
    if (nan) return argmax_scalar(x, n, load);
    const float m = _mm512_reduce_max_ps(best);
    const __mmask16 eq = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    return argmax_tail(x, n, load, i, m, _mm512_mask_reduce_min_epi32(eq, bidx));
  }
#elif defined(__AVX2__)
  if (n >= 16) {
    // the same search on 8 lanes (AVX2-only CPUs, where the engine runs float32)
    __m256 best = load8(x);
    __m256i bidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i idx = bidx;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
    int64_t i = 8;
    for (; i + 8 <= n; i += 8) {
      idx = _mm256_add_epi32(idx, step);
      const __m256 v = load8(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, v, gt);
      bidx = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(bidx), _mm256_castsi256_ps(idx), gt));
    }
    if (_mm256_movemask_ps(nan)) return argmax_scalar(x, n, load);
    alignas(32) float bv[8];
    alignas(32) int32_t bi[8];
    _mm256_store_ps(bv, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bi), bidx);
    float m = bv[0];
    for (int l = 1; l < 8; ++l) m = bv[l] > m ? bv[l] : m;
    int64_t res = n;
    for (int l = 0; l < 8; ++l)
      if (bv[l] == m && bi[l] < res) res = bi[l];
    return argmax_tail(x, n, load, i, m, res);
  }
#endif
  return argmax_scalar(x, n, load);
}

}  // namespace

// argmax over the last dim of [rows, n] (float32 or bfloat16, contiguous rows), int64 [rows]:
// torch.argmax(x, -1)'s indices. torch's CPU reduction took 0.8 ms over a decode step's
// [32, 49152] float32 logits; this reads them once, 16 lanes at a time (~0.1 ms). bf16
// rows are read as they are (a greedy batch's logits need no float32 copy). Rows are
// split over torch's threads from 8 rows (the LM head's GEMM just left them spinning).
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "argmax_rows: a CPU [rows, n > 0] tensor with contiguous rows is required");
  check_cpu_float(x, "argmax_rows");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat) {
    const float* p = x.data_ptr<float>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) o[r] = argmax_row(p + r * ld, n, F32::load);
    });
  } else {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr());
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) o[r] = argmax_row(p + r * ld, n, BF16::load);
    });
  }
  return out;
}

}  // namespace pdserve
