// Branch-free float math that GCC auto-vectorises: an exp accurate to about 1 ulp over the whole
// float range and the logistic sigmoid built on it. Written with selects and integer bit tricks
// only (no libm calls, no tables) so that a plain loop calling them inside a KUAI_CLONE kernel
// becomes AVX-512 / AVX2 / SSE2 code. Used by GELU, softmax and (by other kernels) anything else
// that needs exp in a hot loop.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "kuai/backend/cpu/float_vec.h"

namespace kuai::cpu::vm {

// c ? a : b on the bits. A plain ?: between computed floats is turned back into a branch (the
// arms are sunk into it) and, under the default -ftrapping-math, GCC will not if-convert a
// branch around a float operation, so the loop would stay scalar on AVX2/SSE2.
[[gnu::always_inline]] inline float select(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return std::bit_cast<float>((std::bit_cast<uint32_t>(a) & m) | (std::bit_cast<uint32_t>(b) & ~m));
}

// x clamped to [lo, hi] (lo < 0 < hi, both finite) on its bits, with two integer minima: as
// signed integers the floats up to +inf keep their order and every negative float lies below hi;
// as unsigned ones the non-negative floats lie below every negative one, and the negative ones
// grow with their magnitude. One vpminsd and one vpminud at AVX2 and AVX-512, where a compare and
// a blend for each bound cost 3-4 times the micro-ops (vpblendvb is 2-3 of them on Intel cores),
// with the same result for every float but NaN, which becomes hi (sign clear) or lo (sign set).
[[gnu::always_inline]] inline float clamp_bits(float x, float lo, float hi) {
  const auto xb = std::bit_cast<int32_t>(x);
  const auto hb = std::bit_cast<int32_t>(hi);
  const auto below_hi = static_cast<uint32_t>(xb < hb ? xb : hb);
  const auto lb = std::bit_cast<uint32_t>(lo);
  return std::bit_cast<float>(below_hi < lb ? below_hi : lb);
}

// exp(x) for float x. exp(-inf) = 0, large x -> +inf, NaN -> NaN, results in the subnormal range
// are rounded once (not flushed). Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, a degree-6
// polynomial for exp(r) (Cephes coefficients), then the scale 2^n applied as two factors 2^a 2^b
// (a + b = n) so that n in [-150, 128] never builds an invalid exponent field. Within 1.01 ulp of
// the exact value over every float (tests/backend/cpu/test_softmax.cpp, VecMath.Exp*).
// x is clamped to [kMin, kMax] by clamp_bits: a compare and a blend for each bound made exp_sum
// 1.25-1.35x slower at AVX2 (1.05-1.2x at AVX-512), with the same results bit for bit (every float
// checked at each tier); a NaN, which the clamp turns into kMax or kMin, is given back by the
// last select.
[[gnu::always_inline]] inline float exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // few mantissa bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kMax = 89.0f;          // exp(89) overflows: result +inf
  constexpr float kMin = -104.0f;        // exp(-104) < half the smallest subnormal: result 0
  const float xc = vm::clamp_bits(x, kMin, kMax);
  const float t = xc * kLog2e + kRound;
  const int32_t n = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kRound);
  const float nf = t - kRound;
  float r = xc - nf * kLn2Hi;
  r = r - nf * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t a = n >> 1;  // n in [-150, 128]: a, n - a in [-75, 64], valid normal exponents
  const float sa = std::bit_cast<float>(static_cast<uint32_t>(a + 127) << 23);
  const float sb = std::bit_cast<float>(static_cast<uint32_t>(n - a + 127) << 23);
  const float y = (p * sa) * sb;
  return vm::select(x != x, x, y);
}

// max over j < n of scale * x[j] (-inf for n = 0). A NaN entry is skipped (its comparison is
// false), as std::max(m, v) skips it. 32 running maxima in GCC vectors of W floats: four of 8 (an
// AVX register each, or half an AVX-512 one) in the AVX2 and AVX-512 copies; eight of 4 in the
// baseline copy (W = 4: at SSE2 GCC 12 compares and selects 8-float vectors one lane at a time,
// with branches, which made this 12x slower than the 4-float form), the same 32 slots combined in
// the same order, so both give the same bits. A plain chain, m = std::max(m, x[j]) under `omp
// simd reduction(max)`, was left scalar by GCC 12 in flash attention's row maximum (std::max's
// NaN and signed-zero rules are not a vector max): one vmaxss per element on the latency of the
// last, twice the time of the exp after it (29% against 14% of flash's forward on Emerald
// Rapids). The maximum is exact, so the result is the chain's in any order (up to which of +0 and
// -0 is returned for a zero maximum).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
template <int W>
[[gnu::always_inline]] inline float max_of(const float* x, int64_t n, float scale = 1.0f) {
  static_assert(W == 4 || W == 8);
  using vec = typename FloatVec<W>::type;
  constexpr int kSlots = 32, kVecs = kSlots / W, kHalf = 8 / W;  // kHalf vectors hold 8 slots
  const vec lowest = vec{} - __builtin_inff();
  vec acc[kVecs];
  for (int k = 0; k < kVecs; ++k) acc[k] = lowest;
  int64_t j = 0;
  for (; j + kSlots <= n; j += kSlots)
    for (int k = 0; k < kVecs; ++k) {
      vec v;
      __builtin_memcpy(&v, x + j + k * W, sizeof(v));
      v *= scale;
      acc[k] = v > acc[k] ? v : acc[k];
    }
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < kHalf; ++k) {
      vec v;
      __builtin_memcpy(&v, x + j + k * W, sizeof(v));
      v *= scale;
      acc[k] = v > acc[k] ? v : acc[k];
    }
  float m = -__builtin_inff();
  for (; j < n; ++j) {
    const float v = scale * x[j];
    m = v > m ? v : m;
  }
  // Slots s and s + 8, then s + 16 and s + 24, then the two results, for s < 8; then s = 0..7.
  for (int h = 0; h < kHalf; ++h) {
    const vec a = acc[h] > acc[kHalf + h] ? acc[h] : acc[kHalf + h];
    const vec b = acc[2 * kHalf + h] > acc[3 * kHalf + h] ? acc[2 * kHalf + h] : acc[3 * kHalf + h];
    const vec c = a > b ? a : b;
    for (int k = 0; k < W; ++k) m = c[k] > m ? c[k] : m;
  }
  return m;
}
#pragma GCC diagnostic pop

// y[j] = exp(scale * x[j] - shift) for j < n (y may be x), and their sum: sixteen lanes, lane k
// adding the entries j = k mod 16 in order, then the lanes added pairwise in a fixed order, so the
// sum does not depend on threads or on where a row starts. The last n % 16 entries run as one
// more 16-wide step through a buffer rather than one scalar exp each (a causal row's tail was
// about as costly as its vector body); lanes past the tail add +0, which leaves them as they were.
[[gnu::always_inline]] inline float exp_sum(const float* x, float* y, int64_t n, float scale,
                                            float shift) {
  constexpr int kLanes = 16;
  float lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) {
      const float e = vm::exp(scale * x[j + k] - shift);
      y[j + k] = e;
      lane[k] += e;
    }
  if (const int64_t rem = n - j; rem > 0) {
    float t[kLanes] = {};
    __builtin_memcpy(t, x + j, static_cast<size_t>(rem) * sizeof(float));
    for (int k = 0; k < kLanes; ++k) {
      const float e = vm::select(k < rem, vm::exp(scale * t[k] - shift), 0.0f);
      t[k] = e;
      lane[k] += e;
    }
    __builtin_memcpy(y + j, t, static_cast<size_t>(rem) * sizeof(float));
  }
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int k = 0; k < w; ++k) lane[k] += lane[k + w];
  return lane[0];
}

// Logistic sigmoid 1 / (1 + exp(-z)) and its complement 1 - sigmoid(z) = sigmoid(-z), both with
// small relative error everywhere (no cancellation): with t = exp(-|z|) <= 1, the one on the
// side of z is 1 / (1 + t) and the other t / (1 + t).
// sigmoid_pair_finite is the same for a z that cannot be NaN (GELU's, whose argument is clamped),
// without the two selects that give a NaN back.
[[gnu::always_inline]] inline void sigmoid_pair_finite(float z, float& s, float& sc) {
  const float az = __builtin_fabsf(z);
  const float t = vm::exp(-az);
  const float inv = 1.0f / (1.0f + t);
  const float big = inv;
  const float small = t * inv;
  s = vm::select(z >= 0.0f, big, small);
  sc = vm::select(z >= 0.0f, small, big);
}
[[gnu::always_inline]] inline void sigmoid_pair(float z, float& s, float& sc) {
  vm::sigmoid_pair_finite(z, s, sc);
  s = vm::select(z != z, z, s);
  sc = vm::select(z != z, z, sc);
}

}  // namespace kuai::cpu::vm
