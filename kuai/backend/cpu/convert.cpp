// The bulk dtype converter behind the Cast primitive and the kernels that widen or narrow their
// operands: fast loops per ISA tier (KUAI_CLONE, isa.h) for the float conversions the engine
// uses every step, F16C for the f16 directions where the tier has it, bit-identical to the scalar
// conversions of kuai/core/dtype.h; every other pair through double, element by element.
#include "kuai/backend/cpu/convert.h"

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kuai/backend/cpu/isa.h"

namespace kuai {
namespace {

// One chunk of each fast conversion, compiled per ISA (KUAI_CLONE, isa.h): the element functions
// are inlined (no call per element), so the loops vectorise. These are the portable versions; the
// f16 directions have F16C versions below, used wherever the CPU has F16C.
KUAI_KERNEL void f32_to_bf16_chunk_kernel(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
}
KUAI_CLONE(f32_to_bf16_chunk, f32_to_bf16_chunk_kernel)
KUAI_KERNEL void bf16_to_f32_chunk_kernel(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_float(s[i]);
}
KUAI_CLONE(bf16_to_f32_chunk, bf16_to_f32_chunk_kernel)
KUAI_KERNEL void f32_to_f16_portable_kernel(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_f16(s[i]);
}
KUAI_CLONE(f32_to_f16_portable, f32_to_f16_portable_kernel)
KUAI_KERNEL void f16_to_f32_portable_kernel(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = f16_to_float(s[i]);
}
KUAI_CLONE(f16_to_f32_portable, f16_to_f32_portable_kernel)

// F16C: vcvtps2ph / vcvtph2ps on 8 elements at a time, scalar tail. The scalar functions above
// agree with the instructions bit for bit on every input (rounding to nearest even with the
// immediate, NaN quieted with its top payload bits kept, overflow to inf, subnormals, signed
// zeros); tests/core/test_dtype.cpp checks it. Used from the avx2 tier up (isa.h), so
// KUAI_MAX_ISA=baseline runs the portable loops. GCC builds only (clang 14 cannot test for F16C).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KUAI_HAVE_F16C_PATH 1

__attribute__((target("avx2,f16c"))) void f32_to_f16_f16c(const float* s, uint16_t* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i lo = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
    const __m128i hi = _mm256_cvtps_ph(_mm256_loadu_ps(s + i + 8), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 8), hi);
  }
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
  }
  for (; i < n; ++i) d[i] = float_to_f16(s[i]);
}

__attribute__((target("avx2,f16c"))) void f16_to_f32_f16c(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 8));
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(lo));
    _mm256_storeu_ps(d + i + 8, _mm256_cvtph_ps(hi));
  }
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(d + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  }
  for (; i < n; ++i) d[i] = f16_to_float(s[i]);
}

bool cpu_has_f16c() { return cpu::isa() >= cpu::Isa::kAvx2; }
#endif

void f32_to_f16_chunk(const float* s, uint16_t* d, int64_t n) {
#ifdef KUAI_HAVE_F16C_PATH
  if (cpu_has_f16c()) return f32_to_f16_f16c(s, d, n);
#endif
  f32_to_f16_portable(s, d, n);
}

void f16_to_f32_chunk(const uint16_t* s, float* d, int64_t n) {
#ifdef KUAI_HAVE_F16C_PATH
  if (cpu_has_f16c()) return f16_to_f32_f16c(s, d, n);
#endif
  f16_to_f32_portable(s, d, n);
}

}  // namespace

void convert_serial(const void* src, DType st, void* dst, DType dt, int64_t n) {
  if (n <= 0) return;
  if (st == dt) {
    std::memcpy(dst, src, static_cast<size_t>(n * dtype_size(st)));
    return;
  }
  // Fast paths for the float conversions the engine uses every step.
  if (st == DType::kF32 && dt == DType::kBF16)
    return f32_to_bf16_chunk(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n);
  if (st == DType::kBF16 && dt == DType::kF32)
    return bf16_to_f32_chunk(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n);
  if (st == DType::kF32 && dt == DType::kF16)
    return f32_to_f16_chunk(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n);
  if (st == DType::kF16 && dt == DType::kF32)
    return f16_to_f32_chunk(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n);
  // General path through double: exact for every value of the 32-bit and smaller types.
  for (int64_t i = 0; i < n; ++i) {
    double v = load_element(src, st, i);
    if (!is_floating(dt) && std::isnan(v)) v = 0;
    store_element(dst, dt, i, v);
  }
}

// convert_serial over chunks of kChunk elements, in parallel for large n (not when already inside
// a parallel region). Every element is converted by the same code whatever the thread count.
void convert(const void* src, DType st, void* dst, DType dt, int64_t n) {
  constexpr int64_t kChunk = 1 << 14;
  if (n <= kChunk) return convert_serial(src, st, dst, dt, n);
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  const int64_t ss = dtype_size(st), ds = dtype_size(dt);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > (1 << 16) && !omp_in_parallel())
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i = c * kChunk;
    convert_serial(s + i * ss, st, d + i * ds, dt, std::min(kChunk, n - i));
  }
}

}  // namespace kuai
