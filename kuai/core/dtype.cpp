// Scalar fp16 conversions and the bulk dtype converter behind the Cast primitive.
#include "kuai/core/dtype.h"

#include <algorithm>

#include "kuai/backend/cpu/isa.h"

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
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // Subnormal: normalise.
  float v = static_cast<float>(mant) * 5.9604644775390625e-08f;  // 2^-24
  return sign ? -v : v;
}

namespace {

double load(const void* src, DType t, int64_t i) {
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

void store(void* dst, DType t, int64_t i, double v) {
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

// One chunk of each fast conversion, compiled per ISA (KUAI_CLONES): the element functions are
// inlined (no call per element), so the loops vectorise; the x86-64-v3 clone has F16C.
KUAI_CLONES void f32_to_bf16_chunk(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
}
KUAI_CLONES void bf16_to_f32_chunk(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_float(s[i]);
}
KUAI_CLONES void f32_to_f16_chunk(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_f16(s[i]);
}
KUAI_CLONES void f16_to_f32_chunk(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = f16_to_float(s[i]);
}

// chunk(src + i, dst + i, len) over [0, n), in parallel for large n.
template <typename S, typename D, typename Chunk>
void map_chunks(const void* src, void* dst, int64_t n, Chunk chunk) {
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i = c * kChunk;
    chunk(s + i, d + i, std::min(kChunk, n - i));
  }
}

}  // namespace

void convert(const void* src, DType st, void* dst, DType dt, int64_t n) {
  if (st == dt) {
    std::memcpy(dst, src, static_cast<size_t>(n * dtype_size(st)));
    return;
  }
  // Fast paths for the float conversions the engine uses every step.
  if (st == DType::kF32 && dt == DType::kBF16)
    return map_chunks<float, uint16_t>(src, dst, n, f32_to_bf16_chunk);
  if (st == DType::kBF16 && dt == DType::kF32)
    return map_chunks<uint16_t, float>(src, dst, n, bf16_to_f32_chunk);
  if (st == DType::kF32 && dt == DType::kF16)
    return map_chunks<float, uint16_t>(src, dst, n, f32_to_f16_chunk);
  if (st == DType::kF16 && dt == DType::kF32)
    return map_chunks<uint16_t, float>(src, dst, n, f16_to_f32_chunk);
  // General path through double: exact for every value of the 32-bit and smaller types.
  for (int64_t i = 0; i < n; ++i) {
    double v = load(src, st, i);
    if (!is_floating(dt) && std::isnan(v)) v = 0;
    store(dst, dt, i, v);
  }
}

}  // namespace kuai
