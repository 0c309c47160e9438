// dtype names, the scalar fp16 conversions, and element access by dtype. The bulk converter
// behind the Cast primitive (parallel, F16C where the CPU has it) is a CPU kernel:
// kuai/backend/cpu/convert.h.
#include "kuai/core/dtype.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace kuai {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kU8:
      return "uint8";
  }
  return "unknown";
}

uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u)
    return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;                          // rounds to >= 65520: inf
  if (abs >= 0x38800000u) {          // normal half (|f| >= 2^-14)
    uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);  // round to nearest even on 13 dropped bits
    return sign | static_cast<uint16_t>(r >> 13);
  }
  if (abs < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): zero
  // Subnormal half: value = m * 2^-24 with m < 1024. Shift the full 24-bit significand.
  const uint32_t exp = abs >> 23;
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exp;  // 14..24 (exp in 101..112)
  uint32_t m = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (m & 1u))) ++m;  // may carry into the smallest normal: correct
  return sign | static_cast<uint16_t>(m);
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) {
    // inf, or NaN: quieted (payload kept) exactly as vcvtph2ps does with a signalling half NaN.
    return bits_float(sign | 0x7f800000u | (mant != 0 ? 0x400000u : 0u) | (mant << 13));
  }
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // Subnormal: normalise.
  float v = static_cast<float>(mant) * 5.9604644775390625e-08f;  // 2^-24
  return sign ? -v : v;
}

double load_element(const void* src, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(src)[i];
    case DType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(src)[i]);
    case DType::kF16:
      return f16_to_float(static_cast<const uint16_t*>(src)[i]);
    case DType::kI32:
      return static_cast<const int32_t*>(src)[i];
    case DType::kI64:
      return static_cast<double>(static_cast<const int64_t*>(src)[i]);
    case DType::kU8:
      return static_cast<const uint8_t*>(src)[i];
  }
  return 0;
}

void store_element(void* dst, DType t, int64_t i, double v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(dst)[i] = static_cast<float>(v);
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(dst)[i] = float_to_bf16(static_cast<float>(v));
      return;
    case DType::kF16:
      static_cast<uint16_t*>(dst)[i] = float_to_f16(static_cast<float>(v));
      return;
    case DType::kI32:
      static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(v);
      return;
    case DType::kI64:
      static_cast<int64_t*>(dst)[i] = static_cast<int64_t>(v);
      return;
    case DType::kU8:
      static_cast<uint8_t*>(dst)[i] = static_cast<uint8_t>(v);
      return;
  }
}

}  // namespace kuai
