// SiLU and the SwiGLU gate of LLaMA's MLP, forward and backward, on fp32, bf16 or f16 storage.
// silu(a) = a sigmoid(a); swiglu(h) = silu(h[:, :F]) * h[:, F:] over rows of h (rows, 2F), the
// gate and up projections side by side as one fused linear writes them, so the backward writes
// both halves of one (rows, 2F) gradient (which is the fused linear's output gradient as is).
// fp32 and bf16 compute in registers (bf16 widened on load, rounded once on store); f16 is
// widened a piece at a time into a per-thread buffer (GCC 12 has no fast f16 arithmetic without
// AVX512-FP16). The math is fp32 either way, so every dtype gives the fp32 result rounded once.
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

constexpr int64_t kChunk = int64_t{1} << 13;  // elements per task: ~30 flops each
constexpr int64_t kPiece = int64_t{1} << 10;  // f16 elements widened at a time

// silu(a) and silu'(a) = s (1 + a (1 - s)), s = sigmoid(a).
[[gnu::always_inline]] inline void silu_pair(float a, float& y, float& dy) {
  float s, sc;
  vm::sigmoid_pair(a, s, sc);
  y = a * s;
  dy = s * (1.0f + a * sc);
}

template <class T>
[[gnu::always_inline]] inline void silu_fwd_body(const T* x, T* y, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float v, d;
    silu_pair(load(x, i), v, d);
    store(y, i, v);
  }
}
template <class T>
[[gnu::always_inline]] inline void silu_bwd_body(const T* x, const T* dy, T* dx, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float v, d;
    silu_pair(load(x, i), v, d);
    store(dx, i, load(dy, i) * d);
  }
}
// One row piece: a = gate, b = up, y = silu(a) b.
template <class T>
[[gnu::always_inline]] inline void swiglu_fwd_body(const T* a, const T* b, T* y, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float s, d;
    silu_pair(load(a, i), s, d);
    store(y, i, s * load(b, i));
  }
}
// da = dy b silu'(a), db = dy silu(a).
template <class T>
[[gnu::always_inline]] inline void swiglu_bwd_body(const T* a, const T* b, const T* dy, T* da,
                                                   T* db, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float s, d;
    silu_pair(load(a, i), s, d);
    const float g = load(dy, i);
    const float bi = load(b, i);
    store(da, i, g * bi * d);
    store(db, i, g * s);
  }
}

KUAI_KERNEL void silu_fwd_f32_kernel(const float* x, float* y, int64_t n) {
  silu_fwd_body(x, y, n);
}
KUAI_CLONE(silu_fwd_f32, silu_fwd_f32_kernel)
KUAI_KERNEL void silu_fwd_bf16_kernel(const uint16_t* x, uint16_t* y, int64_t n) {
  silu_fwd_body(x, y, n);
}
KUAI_CLONE(silu_fwd_bf16, silu_fwd_bf16_kernel)
KUAI_KERNEL void silu_bwd_f32_kernel(const float* x, const float* dy, float* dx, int64_t n) {
  silu_bwd_body(x, dy, dx, n);
}
KUAI_CLONE(silu_bwd_f32, silu_bwd_f32_kernel)
KUAI_KERNEL void silu_bwd_bf16_kernel(const uint16_t* x, const uint16_t* dy, uint16_t* dx,
                                      int64_t n) {
  silu_bwd_body(x, dy, dx, n);
}
KUAI_CLONE(silu_bwd_bf16, silu_bwd_bf16_kernel)
KUAI_KERNEL void swiglu_fwd_f32_kernel(const float* a, const float* b, float* y, int64_t n) {
  swiglu_fwd_body(a, b, y, n);
}
KUAI_CLONE(swiglu_fwd_f32, swiglu_fwd_f32_kernel)
KUAI_KERNEL void swiglu_fwd_bf16_kernel(const uint16_t* a, const uint16_t* b, uint16_t* y,
                                        int64_t n) {
  swiglu_fwd_body(a, b, y, n);
}
KUAI_CLONE(swiglu_fwd_bf16, swiglu_fwd_bf16_kernel)
KUAI_KERNEL void swiglu_bwd_f32_kernel(const float* a, const float* b, const float* dy, float* da,
                                       float* db, int64_t n) {
  swiglu_bwd_body(a, b, dy, da, db, n);
}
KUAI_CLONE(swiglu_bwd_f32, swiglu_bwd_f32_kernel)
KUAI_KERNEL void swiglu_bwd_bf16_kernel(const uint16_t* a, const uint16_t* b, const uint16_t* dy,
                                        uint16_t* da, uint16_t* db, int64_t n) {
  swiglu_bwd_body(a, b, dy, da, db, n);
}
KUAI_CLONE(swiglu_bwd_bf16, swiglu_bwd_bf16_kernel)

// Calls fn(k, begin, end) on pieces of row k's F columns [begin, end) in parallel: whole rows
// per task when F is small, slices of a row when it is large.
template <class Fn>
void rows_in_pieces(int64_t rows, int64_t F, Fn&& fn) {
  if (rows <= 0 || F <= 0) return;
  const int64_t per_row = (F + kChunk - 1) / kChunk;  // tasks per row
  if (per_row > 1) {
    parallel_chunks(rows * per_row, 1, [&](int64_t t, int64_t) {
      const int64_t r = t / per_row, c0 = (t % per_row) * kChunk;
      fn(r, c0, std::min(F, c0 + kChunk));
    });
    return;
  }
  const int64_t rows_per_task = std::max<int64_t>(1, kChunk / F);
  parallel_chunks(rows, rows_per_task, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(r, 0, F);
  });
}

// f16: widen `count` operands of m elements each into buf[k], run the fp32 body, round outputs.
template <int kIn, int kOut, class Body>
void f16_piece(const uint16_t* const (&in)[kIn], uint16_t* const (&out)[kOut], int64_t m,
               Body&& body) {
  alignas(64) float buf[kIn + kOut][kPiece];
  for (int64_t c = 0; c < m; c += kPiece) {
    const int64_t p = std::min(kPiece, m - c);
    for (int k = 0; k < kIn; ++k) convert_serial(in[k] + c, DType::kF16, buf[k], DType::kF32, p);
    body(buf, p);
    for (int k = 0; k < kOut; ++k)
      convert_serial(buf[kIn + k], DType::kF32, out[k] + c, DType::kF16, p);
  }
}

}  // namespace

void silu_forward(const void* x, void* y, int64_t n, DType t) {
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) {
    const int64_t m = e - i;
    if (t == DType::kF32)
      return silu_fwd_f32(static_cast<const float*>(x) + i, static_cast<float*>(y) + i, m);
    const uint16_t* xi = static_cast<const uint16_t*>(x) + i;
    uint16_t* yi = static_cast<uint16_t*>(y) + i;
    if (t == DType::kBF16) return silu_fwd_bf16(xi, yi, m);
    f16_piece<1, 1>({xi}, {yi}, m,
                    [](float(*b)[kPiece], int64_t p) { silu_fwd_f32(b[0], b[1], p); });
  });
}

void silu_backward(const void* x, const void* dy, void* dx, int64_t n, DType t) {
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) {
    const int64_t m = e - i;
    if (t == DType::kF32)
      return silu_bwd_f32(static_cast<const float*>(x) + i, static_cast<const float*>(dy) + i,
                          static_cast<float*>(dx) + i, m);
    const uint16_t* xi = static_cast<const uint16_t*>(x) + i;
    const uint16_t* gi = static_cast<const uint16_t*>(dy) + i;
    uint16_t* di = static_cast<uint16_t*>(dx) + i;
    if (t == DType::kBF16) return silu_bwd_bf16(xi, gi, di, m);
    f16_piece<2, 1>({xi, gi}, {di}, m,
                    [](float(*b)[kPiece], int64_t p) { silu_bwd_f32(b[0], b[1], b[2], p); });
  });
}

void swiglu_forward(const void* h, void* y, int64_t rows, int64_t F, DType t) {
  rows_in_pieces(rows, F, [&](int64_t r, int64_t c0, int64_t c1) {
    const int64_t m = c1 - c0, a = r * 2 * F + c0, o = r * F + c0;
    if (t == DType::kF32) {
      const float* hp = static_cast<const float*>(h);
      return swiglu_fwd_f32(hp + a, hp + a + F, static_cast<float*>(y) + o, m);
    }
    const uint16_t* hp = static_cast<const uint16_t*>(h);
    uint16_t* yp = static_cast<uint16_t*>(y) + o;
    if (t == DType::kBF16) return swiglu_fwd_bf16(hp + a, hp + a + F, yp, m);
    f16_piece<2, 1>({hp + a, hp + a + F}, {yp}, m,
                    [](float(*b)[kPiece], int64_t p) { swiglu_fwd_f32(b[0], b[1], b[2], p); });
  });
}

void swiglu_backward(const void* h, const void* dy, void* dh, int64_t rows, int64_t F, DType t) {
  rows_in_pieces(rows, F, [&](int64_t r, int64_t c0, int64_t c1) {
    const int64_t m = c1 - c0, a = r * 2 * F + c0, o = r * F + c0;
    if (t == DType::kF32) {
      const float* hp = static_cast<const float*>(h);
      float* dp = static_cast<float*>(dh);
      return swiglu_bwd_f32(hp + a, hp + a + F, static_cast<const float*>(dy) + o, dp + a,
                            dp + a + F, m);
    }
    const uint16_t* hp = static_cast<const uint16_t*>(h);
    const uint16_t* gp = static_cast<const uint16_t*>(dy) + o;
    uint16_t* dp = static_cast<uint16_t*>(dh);
    if (t == DType::kBF16) return swiglu_bwd_bf16(hp + a, hp + a + F, gp, dp + a, dp + a + F, m);
    f16_piece<3, 2>(
        {hp + a, hp + a + F, gp}, {dp + a, dp + a + F}, m,
        [](float(*b)[kPiece], int64_t p) { swiglu_bwd_f32(b[0], b[1], b[2], b[3], b[4], p); });
  });
}

}  // namespace kuai::cpu
