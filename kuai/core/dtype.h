// Element types and their conversions. bf16 and f16 are stored as raw 16-bit patterns; the
// conversions from float round to nearest even and keep NaN a NaN (quiet), ±inf, signed zeros
// and (for f16) subnormals, matching what hardware converters (F16C, AVX512-BF16) produce; the
// f16 ones are bit-identical to F16C's vcvtps2ph / vcvtph2ps for every input.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace kuai {

enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kI64, kU8 };

constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kU8:
      return 1;
  }
  return 0;
}

constexpr bool is_floating(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

std::string_view dtype_name(DType t);  // "float32", "bfloat16", ...

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- bfloat16: the upper half of an fp32 pattern ----
// Branch-free (a select), so loops over it vectorise.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // nearest even; overflows
                                                                    // correctly into inf
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// ---- IEEE half: 1 sign, 5 exponent, 10 mantissa bits ----
// float_to_f16 keeps a NaN's sign and top 9 payload bits and sets the quiet bit; f16_to_float
// keeps sign and payload and sets the quiet bit (a signalling half NaN comes back quiet).
uint16_t float_to_f16(float f);
float f16_to_float(uint16_t h);

// Element i of an array of dtype t, as double (exact for every value of every dtype but i64
// beyond 2^53), and the store back (floats to integers truncate toward zero; NaN to an integer
// is 0 only through convert()). For host code that handles a few values; bulk conversion is a
// kernel (kuai/backend/cpu/convert.h, the Cast primitive).
double load_element(const void* src, DType t, int64_t i);
void store_element(void* dst, DType t, int64_t i, double v);

}  // namespace kuai
