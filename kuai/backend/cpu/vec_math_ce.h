// Branch-free float exp for the cross-entropy kernels, for scalars and for 8- and 4-float GCC
// vectors (f32x8: one AVX register or half an AVX-512 one; f32x4, for the baseline copies: at SSE2
// GCC 12 compares and selects f32x8 one lane at a time, f32x4 in one instruction each).
// No libm call and no table; selects instead of branches, so loops over it vectorise. Relative
// error about 2 ulp; exp(x) is 0 for x < -87.33 (no subnormals), +inf for x > 88.37 (a little
// before true float overflow at 88.72; the kernels only call it with x <= 0), NaN for NaN.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

// Everything here is forced inline so that it is compiled for the ISA of the KUAI_CLONE kernel
// that calls it; the vector ABI warning concerns out-of-line calls, which therefore never happen.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#define KUAI_CE_INLINE [[gnu::always_inline]] inline

namespace kuai::cpu::ce {

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

// The number of floats in F (a vector type above or float).
template <class F>
inline constexpr int kWidth = static_cast<int>(sizeof(F) / sizeof(float));

template <class F>
KUAI_CE_INLINE F load(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <class F>
KUAI_CE_INLINE void store(float* p, const F& v) {
  std::memcpy(p, &v, sizeof(v));
}

// A float or an f32x8 with every lane equal to v.
template <class F>
KUAI_CE_INLINE F splat(float v) {
  if constexpr (std::is_same_v<F, float>)
    return v;
  else
    return F{} + v;
}

// F is float (with I = int32_t) or f32x8 (with I = i32x8); comparisons and ?: are lane-wise.
template <class F, class I>
KUAI_CE_INLINE F exp_impl(const F& x) {
  constexpr float kLog2e = 1.44269504088896341f;
  // ln 2 split in a high part with few mantissa bits (k * kLn2Hi is exact) and the remainder.
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kMaxArg = 88.72f;           // k <= 128; 2^128 is built as +inf
  constexpr float kMinArg = -87.33f;          // k >= -126, exp(kMinArg) just above FLT_MIN
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const F hi = splat<F>(kMaxArg), lo = splat<F>(kMinArg);
  // Clamp (min / max instructions); a NaN passes through and poisons every step below.
  F xc = hi < x ? hi : x;
  xc = lo > xc ? lo : xc;
  // x = k ln2 + r with k integer and |r| <= ln2 / 2.
  const F kr = xc * kLog2e + kRoundMagic;
  const F k = kr - kRoundMagic;
  const I ki = __builtin_bit_cast(I, kr) - std::bit_cast<int32_t>(kRoundMagic);
  F r = xc - k * kLn2Hi;
  r = r - k * kLn2Lo;
  // Taylor polynomial of exp(r) to degree 7: truncation error < 3e-9 for |r| <= ln2 / 2.
  F p = splat<F>(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // Scale by 2^k through the exponent bits: k in [-126, 127] gives a normal float, k = 128 the
  // bit pattern of +inf (so every x above about 88.37 overflows to +inf).
  const F y = p * __builtin_bit_cast(F, (ki + 127) << 23);
  return x < lo ? splat<F>(0.0f) : y;
}

KUAI_CE_INLINE float exp_fast(float x) { return exp_impl<float, int32_t>(x); }
KUAI_CE_INLINE f32x8 exp_fast(const f32x8& x) { return exp_impl<f32x8, i32x8>(x); }
KUAI_CE_INLINE f32x4 exp_fast(const f32x4& x) { return exp_impl<f32x4, i32x4>(x); }

}  // namespace kuai::cpu::ce

#pragma GCC diagnostic pop
