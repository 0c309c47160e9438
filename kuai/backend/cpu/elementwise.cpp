// Elementwise CPU kernels: binary arithmetic, scale/axpy/fill, row-broadcast add/mul and the tanh
// GELU with its exact derivative. Each op is an OpenMP loop over fixed-size chunks; the per-chunk
// loop is a KUAI_CLONE kernel, so it runs as AVX-512, AVX2+FMA or SSE2 code depending on the
// CPU. Outputs may alias an input exactly (y == a for in-place use), never partially.
#include <algorithm>
#include <cstdint>

#include "kuai/backend/cpu/bf16_access.h"
#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/parallel_chunks.h"
#include "kuai/backend/cpu/vec_math.h"
#include "kuai/core/dtype.h"

namespace kuai::cpu {
namespace {

// Memory-bound ops: 32K floats (128 KiB per array) per chunk keeps the fork cost (~1-2 us) well
// below the chunk time. GELU does ~30 flops per element, so smaller chunks already pay off.
constexpr int64_t kChunk = int64_t{1} << 15;
constexpr int64_t kGeluChunk = int64_t{1} << 13;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
// Beyond |x| = kGeluClamp, gelu(x) is x or -0 and gelu'(x) is 1 or 0 in float; clamping the
// argument of the polynomial keeps x^3 finite, so +-inf give the limits instead of inf * 0.
constexpr float kGeluClamp = 1.0e4f;

enum class Binary { kAdd, kSub, kMul, kDiv };

template <Binary kOp>
[[gnu::always_inline]] inline float apply(float a, float b) {
  if constexpr (kOp == Binary::kAdd) return a + b;
  if constexpr (kOp == Binary::kSub) return a - b;
  if constexpr (kOp == Binary::kMul) return a * b;
  return a / b;
}

template <Binary kOp>
[[gnu::always_inline]] inline void binary_loop(const float* a, const float* b, float* y,
                                               int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) y[i] = apply<kOp>(a[i], b[i]);
}

KUAI_KERNEL void add_chunk_kernel(const float* a, const float* b, float* y, int64_t n) {
  binary_loop<Binary::kAdd>(a, b, y, n);
}
KUAI_CLONE(add_chunk, add_chunk_kernel)
KUAI_KERNEL void sub_chunk_kernel(const float* a, const float* b, float* y, int64_t n) {
  binary_loop<Binary::kSub>(a, b, y, n);
}
KUAI_CLONE(sub_chunk, sub_chunk_kernel)
KUAI_KERNEL void mul_chunk_kernel(const float* a, const float* b, float* y, int64_t n) {
  binary_loop<Binary::kMul>(a, b, y, n);
}
KUAI_CLONE(mul_chunk, mul_chunk_kernel)
KUAI_KERNEL void div_chunk_kernel(const float* a, const float* b, float* y, int64_t n) {
  binary_loop<Binary::kDiv>(a, b, y, n);
}
KUAI_CLONE(div_chunk, div_chunk_kernel)

KUAI_KERNEL void scale_chunk_kernel(const float* x, float s, float* y, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) y[i] = s * x[i];
}
KUAI_CLONE(scale_chunk, scale_chunk_kernel)

KUAI_KERNEL void axpy_chunk_kernel(float alpha, const float* x, float* y, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}
KUAI_CLONE(axpy_chunk, axpy_chunk_kernel)

KUAI_KERNEL void fill_chunk_kernel(float* y, float value, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = value;
}
KUAI_CLONE(fill_chunk, fill_chunk_kernel)

// x, y (rows, cols); b (cols).
template <Binary kOp>
[[gnu::always_inline]] inline void row_loop(const float* x, const float* b, float* y, int64_t rows,
                                            int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) binary_loop<kOp>(x + r * cols, b, y + r * cols, cols);
}

KUAI_KERNEL void add_row_chunk_kernel(const float* x, const float* b, float* y, int64_t rows,
                                      int64_t cols) {
  row_loop<Binary::kAdd>(x, b, y, rows, cols);
}
KUAI_CLONE(add_row_chunk, add_row_chunk_kernel)
KUAI_KERNEL void mul_row_chunk_kernel(const float* x, const float* b, float* y, int64_t rows,
                                      int64_t cols) {
  row_loop<Binary::kMul>(x, b, y, rows, cols);
}
KUAI_CLONE(mul_row_chunk, mul_row_chunk_kernel)

template <class T>
[[gnu::always_inline]] inline void add_f32_low_body(const float* a, const T* b, float* y,
                                                    int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + load(b, i);
}
KUAI_KERNEL void add_f32_bf16_chunk_kernel(const float* a, const uint16_t* b, float* y, int64_t n) {
  add_f32_low_body(a, b, y, n);
}
KUAI_CLONE(add_f32_bf16_chunk, add_f32_bf16_chunk_kernel)

// gelu(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
// The sigmoid form has no cancellation for negative x, so small outputs keep full relative
// accuracy down to the subnormal range.
template <class T>
[[gnu::always_inline]] inline void gelu_forward_body(const T* x, T* y, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    const float xi = load(x, i);
    const float xc = vm::clamp_bits(xi, -kGeluClamp, kGeluClamp);  // NaN: xi * s below is NaN
    const float z = 2.0f * kSqrt2OverPi * (xc + kGeluCubic * xc * xc * xc);
    float s, sc;
    vm::sigmoid_pair_finite(z, s, sc);  // z is finite: xc is clamped
    store(y, i, vm::select(xi < -kGeluClamp, -0.0f, xi * s));
  }
}
KUAI_KERNEL void gelu_forward_chunk_kernel(const float* x, float* y, int64_t n) {
  gelu_forward_body(x, y, n);
}
KUAI_CLONE(gelu_forward_chunk, gelu_forward_chunk_kernel)
KUAI_KERNEL void gelu_forward_bf16_chunk_kernel(const uint16_t* x, uint16_t* y, int64_t n) {
  gelu_forward_body(x, y, n);
}
KUAI_CLONE(gelu_forward_bf16_chunk, gelu_forward_bf16_chunk_kernel)

// gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u'
//          = s + 2 x s (1 - s) u',  s = sigmoid(2u), u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
template <class T>
[[gnu::always_inline]] inline void gelu_backward_body(const T* x, const T* dy, T* dx, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    const float xi = load(x, i);
    const float xc = vm::clamp_bits(xi, -kGeluClamp, kGeluClamp);
    const float x2 = xc * xc;
    const float z = 2.0f * kSqrt2OverPi * (xc + kGeluCubic * x2 * xc);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x2);
    float s, sc;
    vm::sigmoid_pair_finite(z, s, sc);  // z is finite: xc is clamped
    // A NaN x, which the clamp made finite, gives NaN (itself) as the derivative.
    const float d = vm::select(xi != xi, xi, s + 2.0f * xc * du * (s * sc));
    store(dx, i, load(dy, i) * d);
  }
}
KUAI_KERNEL void gelu_backward_chunk_kernel(const float* x, const float* dy, float* dx, int64_t n) {
  gelu_backward_body(x, dy, dx, n);
}
KUAI_CLONE(gelu_backward_chunk, gelu_backward_chunk_kernel)
KUAI_KERNEL void gelu_backward_bf16_chunk_kernel(const uint16_t* x, const uint16_t* dy,
                                                 uint16_t* dx, int64_t n) {
  gelu_backward_body(x, dy, dx, n);
}
KUAI_CLONE(gelu_backward_bf16_chunk, gelu_backward_bf16_chunk_kernel)

}  // namespace

void add(const float* a, const float* b, float* y, int64_t n) {
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) { add_chunk(a + i, b + i, y + i, e - i); });
}

void sub(const float* a, const float* b, float* y, int64_t n) {
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) { sub_chunk(a + i, b + i, y + i, e - i); });
}

void mul(const float* a, const float* b, float* y, int64_t n) {
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) { mul_chunk(a + i, b + i, y + i, e - i); });
}

void div(const float* a, const float* b, float* y, int64_t n) {
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) { div_chunk(a + i, b + i, y + i, e - i); });
}

void scale(const float* x, float s, float* y, int64_t n) {
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) { scale_chunk(x + i, s, y + i, e - i); });
}

void axpy(float alpha, const float* x, float* y, int64_t n) {
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) { axpy_chunk(alpha, x + i, y + i, e - i); });
}

void fill(float* y, float value, int64_t n) {
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) { fill_chunk(y + i, value, e - i); });
}

// x, y (rows, cols); b (cols). Chunks are whole rows, about kChunk elements each.
void add_row(const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
  if (cols <= 0) return;
  const int64_t rows_per_chunk = std::max<int64_t>(1, kChunk / cols);
  parallel_chunks(rows, rows_per_chunk, [&](int64_t r, int64_t e) {
    add_row_chunk(x + r * cols, b, y + r * cols, e - r, cols);
  });
}

void mul_row(const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
  if (cols <= 0) return;
  const int64_t rows_per_chunk = std::max<int64_t>(1, kChunk / cols);
  parallel_chunks(rows, rows_per_chunk, [&](int64_t r, int64_t e) {
    mul_row_chunk(x + r * cols, b, y + r * cols, e - r, cols);
  });
}

void gelu_forward(const float* x, float* y, int64_t n) {
  parallel_chunks(n, kGeluChunk,
                  [&](int64_t i, int64_t e) { gelu_forward_chunk(x + i, y + i, e - i); });
}

// f16 (F16C, chosen at run time by convert_serial): each chunk is widened into a per-thread
// buffer, the fp32 kernel runs on it, and the result is rounded back. GCC 12 converts _Float16
// in software unless AVX512-FP16 is enabled (measured: 13x slower than this), so f16 is not
// converted in registers like bf16.
constexpr int64_t kF16Chunk = int64_t{1} << 11;

template <class Fn>
void f16_chunks(int64_t n, int64_t chunk, const uint16_t* const* in, int nin, uint16_t* out,
                Fn&& fp32_kernel) {
  parallel_chunks(n, chunk, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[3][kF16Chunk];
    for (int64_t c = begin; c < end; c += kF16Chunk) {
      const int64_t m = std::min(kF16Chunk, end - c);
      for (int k = 0; k < nin; ++k) convert_serial(in[k] + c, DType::kF16, buf[k], DType::kF32, m);
      fp32_kernel(buf[0], buf[1], buf[2], m);
      convert_serial(buf[2], DType::kF32, out + c, DType::kF16, m);
    }
  });
}

void gelu_forward_lowp(const uint16_t* x, uint16_t* y, int64_t n, DType t) {
  if (t == DType::kBF16)
    return parallel_chunks(
        n, kGeluChunk, [&](int64_t i, int64_t e) { gelu_forward_bf16_chunk(x + i, y + i, e - i); });
  const uint16_t* in[] = {x};
  f16_chunks(n, kGeluChunk, in, 1, y, [](const float* a, const float*, float* o, int64_t m) {
    gelu_forward_chunk(a, o, m);
  });
}

void gelu_backward_lowp(const uint16_t* x, const uint16_t* dy, uint16_t* dx, int64_t n, DType t) {
  if (t == DType::kBF16)
    return parallel_chunks(n, kGeluChunk, [&](int64_t i, int64_t e) {
      gelu_backward_bf16_chunk(x + i, dy + i, dx + i, e - i);
    });
  const uint16_t* in[] = {x, dy};
  f16_chunks(n, kGeluChunk, in, 2, dx, [](const float* a, const float* b, float* o, int64_t m) {
    gelu_backward_chunk(a, b, o, m);
  });
}

void add_f32_lowp(const float* a, const uint16_t* b, float* y, int64_t n, DType t) {
  if (t == DType::kBF16)
    return parallel_chunks(
        n, kChunk, [&](int64_t i, int64_t e) { add_f32_bf16_chunk(a + i, b + i, y + i, e - i); });
  parallel_chunks(n, kChunk, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[kF16Chunk];
    for (int64_t c = begin; c < end; c += kF16Chunk) {
      const int64_t m = std::min(kF16Chunk, end - c);
      convert_serial(b + c, DType::kF16, buf, DType::kF32, m);
      add_chunk(a + c, buf, y + c, m);
    }
  });
}

void gelu_backward_serial(const float* x, const float* dy, float* dx, int64_t n) {
  if (n > 0) gelu_backward_chunk(x, dy, dx, n);
}

void gelu_backward(const float* x, const float* dy, float* dx, int64_t n) {
  parallel_chunks(n, kGeluChunk,
                  [&](int64_t i, int64_t e) { gelu_backward_chunk(x + i, dy + i, dx + i, e - i); });
}

}  // namespace kuai::cpu
