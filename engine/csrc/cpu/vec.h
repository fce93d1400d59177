// Helpers the CPU kernels share: bfloat16 <-> float32 and exp on non-positive arguments.
//
// Everything here has internal linkage (an unnamed namespace): each kernel file is
// compiled with its own floating-point flags (engine/layers/cpu_extension.py: the
// attention files with -ffast-math, the fused ops with -ffp-contract=off), and each must
// get its own copy compiled under its flags. An inline function with external linkage
// would let the linker keep one file's copy for all of them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pdserve {
namespace {

// bfloat16 bits -> float: the upper 16 bits of a float (a shift the compiler vectorizes)
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// float -> bfloat16 bits, rounded to nearest even as torch's conversion; NaN stays NaN
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// exp(x) for x <= 0 (scores minus their maximum) in plain arithmetic, so a softmax loop
// vectorizes (libm's expf is a scalar call per element): Cody-Waite range reduction and
// Cephes' degree-5 polynomial, ~1 ulp; below EXP_MIN it returns 0.
constexpr float EXP_MIN = -87.33654f;
constexpr float EXP_LOG2E = 1.44269504088896341f;
constexpr float EXP_LN2_HI = 0.693359375f;
constexpr float EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpos(float x) {
  x = x < EXP_MIN ? EXP_MIN : x;
  const float n = std::floor(x * EXP_LOG2E + 0.5f);
  float r = x - n * EXP_LN2_HI;
  r = r - n * EXP_LN2_LO;
  const float z = r * r;
  float y = EXP_POLY[0];
  for (int i = 1; i < 6; ++i) y = y * r + EXP_POLY[i];
  y = y * z + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return y * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpos on 8 lanes: the same range reduction and polynomial, fused multiply-adds
inline __m256 exp_nonpos8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
  const __m256 n =
      _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 y = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_POLY[i]));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, r), _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
// exp_nonpos on 16 lanes: the same range reduction and polynomial, fused multiply-adds
inline __m512 exp_nonpos16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_POLY[i]));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, r), _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// 2^t on 16 lanes, t finite: t = n + f with n an integer and f in [-0.5, 0.5], 2^f by a
// degree-6 polynomial (relative error ~2e-7), 2^n by scalef, which underflows to 0
// cleanly. Explicit fmadds: the same bits under any -ffp-contract
inline __m512 exp2_16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  for (const float c :
       {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u on 16 float lanes. The sigmoid comes from e = 2^(-|g| log2 e), in (0, 1]
// (exp2_16): 1 / (1 + e) for g >= 0, e / (1 + e) below; NaN stays NaN
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp2_16(_mm512_mul_ps(_mm512_abs_ps(g), _mm512_set1_ps(-1.44269504088896341f)));
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, _mm512_set1_ps(1.0f), e),
                                   _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
  return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}
#endif

}  // namespace
}  // namespace pdserve
