// LayerNorm and RMSNorm over the last axis of x (N, C), forward and backward, fp32. Statistics use
// a corrected two-pass scheme (mean, then the sum of deviations and of their squares, which also
// corrects the mean), so inputs with a large common offset keep full precision. The weight and bias
// gradients are reduced over a row partition that depends only on N, never on the thread count, so
// they are bit-identical whatever OMP_NUM_THREADS is.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/core/dtype.h"

namespace kuai::cpu {
namespace {

constexpr int64_t kLanes = 32;             // independent accumulators per row reduction
constexpr int64_t kMinParallel = 1 << 15;  // elements below which one thread does it all
constexpr int64_t kMaxBwdBlocks = 64;      // row blocks of the dw/db reduction
constexpr int64_t kMinBwdBlockRows = 8;
constexpr int64_t kReduceColChunk = 256;  // columns per task when summing the partials

// Rows [begin, end) of `n` that thread `t` of `nt` owns under an even static split.
inline void thread_range(int64_t n, int t, int nt, int64_t* begin, int64_t* end) {
  const int64_t base = n / nt, extra = n % nt;
  *begin = t * base + std::min<int64_t>(t, extra);
  *end = *begin + base + (t < extra ? 1 : 0);
}

inline float lanes_sum(const float* acc) {
  float s = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// (N, C) rows [r0, r1).
KUAI_KERNEL void forward_rows_kernel(const float* x, const float* w, const float* b, float* y,
                                     float* mean, float* rstd, int64_t r0, int64_t r1, int64_t C,
                                     float eps) {
  const int64_t cv = C - C % kLanes;
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * C;
    float* yr = y + r * C;
    float acc[kLanes] = {};
    for (int64_t c = 0; c < cv; c += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) acc[j] += xr[c + j];
    float sum = lanes_sum(acc);
    for (int64_t c = cv; c < C; ++c) sum += xr[c];
    const float m0 = sum / static_cast<float>(C);

    // Deviations from m0: their sum corrects m0, their squares give the variance.
    float s1[kLanes] = {}, s2[kLanes] = {};
    for (int64_t c = 0; c < cv; c += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) {
        const float d = xr[c + j] - m0;
        s1[j] += d;
        s2[j] += d * d;
      }
    float d1 = lanes_sum(s1), d2 = lanes_sum(s2);
    for (int64_t c = cv; c < C; ++c) {
      const float d = xr[c] - m0;
      d1 += d;
      d2 += d * d;
    }
    const float delta = d1 / static_cast<float>(C);
    const float var = std::max(d2 / static_cast<float>(C) - delta * delta, 0.0f);
    const float rs = 1.0f / std::sqrt(var + eps);
    mean[r] = m0 + delta;
    rstd[r] = rs;
    for (int64_t c = 0; c < C; ++c) yr[c] = ((xr[c] - m0) - delta) * rs * w[c] + b[c];
  }
}
KUAI_CLONE(forward_rows, forward_rows_kernel)

// Rows [r0, r1) of (N, C): writes dx and this block's partial dw, db (C each), overwritten when
// `zero`, else added to (a block may be processed as consecutive pieces: the same sums in the
// same order).
KUAI_KERNEL void backward_block_kernel(const float* dy, const float* x, const float* w,
                                       const float* mean, const float* rstd, float* dx, float* pdw,
                                       float* pdb, int64_t r0, int64_t r1, int64_t C, bool zero) {
  const int64_t cv = C - C % kLanes;
  if (zero) {
    for (int64_t c = 0; c < C; ++c) pdw[c] = 0.0f;
    for (int64_t c = 0; c < C; ++c) pdb[c] = 0.0f;
  }
  for (int64_t r = r0; r < r1; ++r) {
    const float* dyr = dy + r * C;
    const float* xr = x + r * C;
    float* dxr = dx + r * C;
    const float m = mean[r], rs = rstd[r];
    // dxhat = dy * w; needs mean(dxhat) and mean(dxhat * xhat) over the row.
    float a1[kLanes] = {}, a2[kLanes] = {};
    for (int64_t c = 0; c < cv; c += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) {
        const float g = dyr[c + j];
        const float xh = (xr[c + j] - m) * rs;
        const float dxh = g * w[c + j];
        a1[j] += dxh;
        a2[j] += dxh * xh;
        pdw[c + j] += g * xh;
        pdb[c + j] += g;
      }
    float sum1 = lanes_sum(a1), sum2 = lanes_sum(a2);
    for (int64_t c = cv; c < C; ++c) {
      const float g = dyr[c];
      const float xh = (xr[c] - m) * rs;
      const float dxh = g * w[c];
      sum1 += dxh;
      sum2 += dxh * xh;
      pdw[c] += g * xh;
      pdb[c] += g;
    }
    const float mean1 = sum1 / static_cast<float>(C);
    const float mean2 = sum2 / static_cast<float>(C);
    for (int64_t c = 0; c < C; ++c) {
      const float xh = (xr[c] - m) * rs;
      dxr[c] = rs * (dyr[c] * w[c] - mean1 - xh * mean2);
    }
  }
}
KUAI_CLONE(backward_block, backward_block_kernel)

// out[c] = sum over blocks b (in order) of part[b * stride + c], for c in [c0, c1).
KUAI_KERNEL void sum_partials_kernel(const float* part, int64_t blocks, int64_t stride, float* out,
                                     int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) out[c] = 0.0f;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float* p = part + blk * stride;
    for (int64_t c = c0; c < c1; ++c) out[c] += p[c];
  }
}
KUAI_CLONE(sum_partials, sum_partials_kernel)

// acc[i] += d[i]: its own function, so the sum is rounded exactly as a separate add_ rounds it.
KUAI_KERNEL void accumulate_kernel(float* acc, const float* d, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + d[i];
}
KUAI_CLONE(accumulate, accumulate_kernel)

// RMSNorm (N, C) rows [r0, r1): y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
KUAI_KERNEL void rms_forward_rows_kernel(const float* x, const float* w, float* y, float* rstd,
                                         int64_t r0, int64_t r1, int64_t C, float eps) {
  const int64_t cv = C - C % kLanes;
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * C;
    float* yr = y + r * C;
    float acc[kLanes] = {};
    for (int64_t c = 0; c < cv; c += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) acc[j] += xr[c + j] * xr[c + j];
    float ss = lanes_sum(acc);
    for (int64_t c = cv; c < C; ++c) ss += xr[c] * xr[c];
    const float rs = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
    rstd[r] = rs;
    for (int64_t c = 0; c < C; ++c) yr[c] = xr[c] * rs * w[c];
  }
}
KUAI_CLONE(rms_forward_rows, rms_forward_rows_kernel)

// RMSNorm backward of rows [r0, r1): dx, and this block's partial dw (overwritten when `zero`).
// With xhat = x rstd and g = dy w: dx = rstd (g - xhat mean(g xhat)), dw = sum over rows dy xhat.
KUAI_KERNEL void rms_backward_block_kernel(const float* dy, const float* x, const float* w,
                                           const float* rstd, float* dx, float* pdw, int64_t r0,
                                           int64_t r1, int64_t C, bool zero) {
  const int64_t cv = C - C % kLanes;
  if (zero)
    for (int64_t c = 0; c < C; ++c) pdw[c] = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float* dyr = dy + r * C;
    const float* xr = x + r * C;
    float* dxr = dx + r * C;
    const float rs = rstd[r];
    float a2[kLanes] = {};
    for (int64_t c = 0; c < cv; c += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) {
        const float g = dyr[c + j];
        const float xh = xr[c + j] * rs;
        a2[j] += g * w[c + j] * xh;
        pdw[c + j] += g * xh;
      }
    float sum2 = lanes_sum(a2);
    for (int64_t c = cv; c < C; ++c) {
      const float g = dyr[c];
      const float xh = xr[c] * rs;
      sum2 += g * w[c] * xh;
      pdw[c] += g * xh;
    }
    const float mean2 = sum2 / static_cast<float>(C);
    for (int64_t c = 0; c < C; ++c) dxr[c] = rs * (dyr[c] * w[c] - xr[c] * rs * mean2);
  }
}
KUAI_CLONE(rms_backward_block, rms_backward_block_kernel)

// The row partition of the dw/db reduction: a function of N only.
inline int64_t backward_rows_per_block(int64_t N) {
  return std::max((N + kMaxBwdBlocks - 1) / kMaxBwdBlocks, std::min(N, kMinBwdBlockRows));
}

}  // namespace

void layer_norm_forward(const float* x, const float* w, const float* b, float* y, float* mean,
                        float* rstd, int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
#pragma omp parallel if (N * C >= kMinParallel && N > 1)
  {
    int64_t r0, r1;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
    if (r0 < r1) forward_rows(x, w, b, y, mean, rstd, r0, r1, C, eps);
  }
}

void add_layer_norm_forward(const float* a, const void* b, DType b_dtype, float* x, const float* w,
                            const float* bias, float* y, float* mean, float* rstd, int64_t N,
                            int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  // Blocks of about 32 KiB of x: the add writes them, the statistics read them back from L1/L2.
  const int64_t block = std::max<int64_t>(1, (int64_t{1} << 13) / C);
  const size_t b_size = dtype_size(b_dtype);
#pragma omp parallel if (N * C >= kMinParallel && N > 1)
  {
    // A bf16 / f16 branch is widened a block at a time (exactly: every value is an fp32 value),
    // so each sum is the fp32 a + b the separate add rounds.
    static thread_local std::vector<float> wide;
    if (b_dtype != DType::kF32 && wide.size() < static_cast<size_t>(block * C))
      wide.resize(static_cast<size_t>(block * C));
    int64_t r0, r1;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
    for (int64_t r = r0; r < r1; r += block) {
      const int64_t e = std::min(r1, r + block);
      const int64_t n = (e - r) * C;
      const float* pa = a + r * C;
      const float* pb = static_cast<const float*>(b) + r * C;
      if (b_dtype != DType::kF32) {
        convert_serial(static_cast<const char*>(b) + static_cast<size_t>(r * C) * b_size, b_dtype,
                       wide.data(), DType::kF32, n);
        pb = wide.data();
      }
      float* px = x + r * C;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) px[i] = pa[i] + pb[i];
      forward_rows(x, w, bias, y, mean, rstd, r, e, C, eps);
    }
  }
}

namespace {

// The backward's row blocks (a partition that depends on N only: what makes dw, db deterministic)
// run in parallel: `rows(r0, r1, pdw, pdb)` writes dx of rows [r0, r1) and the block's partial
// dw, db; then the partials are summed in block order. db may be null (RMSNorm: no bias), and
// then pdb is too.
template <class Rows>
void backward_blocks(float* dw, float* db, int64_t N, int64_t C, Rows&& rows) {
  if (C <= 0) return;
  const int64_t parts = db != nullptr ? 2 : 1;
  if (N <= 0) {
    std::fill(dw, dw + C, 0.0f);
    if (db != nullptr) std::fill(db, db + C, 0.0f);
    return;
  }
  const int64_t rows_per_block = backward_rows_per_block(N);
  const int64_t blocks = (N + rows_per_block - 1) / rows_per_block;
  // (blocks, parts, C): per block, partial dw then partial db.
  static thread_local std::vector<float> partials;
  if (partials.size() < static_cast<size_t>(blocks * parts * C))
    partials.resize(blocks * parts * C);
  float* part = partials.data();
  const int64_t col_chunks = (C + kReduceColChunk - 1) / kReduceColChunk;

#pragma omp parallel if (N * C >= kMinParallel && N > 1)
  {
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t r0 = blk * rows_per_block;
      float* pdw = part + blk * parts * C;
      rows(r0, std::min(N, r0 + rows_per_block), pdw, parts == 2 ? pdw + C : nullptr);
    }
#pragma omp for schedule(static)
    for (int64_t k = 0; k < parts * col_chunks; ++k) {
      const bool is_db = k >= col_chunks;
      const int64_t c0 = (k % col_chunks) * kReduceColChunk;
      const int64_t c1 = std::min(C, c0 + kReduceColChunk);
      sum_partials(part + (is_db ? C : 0), blocks, parts * C, is_db ? db : dw, c0, c1);
    }
  }
}

}  // namespace

void layer_norm_backward(const float* dy, const float* x, const float* w, const float* mean,
                         const float* rstd, float* dx, float* dw, float* db, int64_t N, int64_t C) {
  backward_blocks(dw, db, N, C, [&](int64_t r0, int64_t r1, float* pdw, float* pdb) {
    backward_block(dy, x, w, mean, rstd, dx, pdw, pdb, r0, r1, C, true);
  });
}

void layer_norm_backward_add(const float* dy, const float* x, const float* w, const float* mean,
                             const float* rstd, float* acc, float* dw, float* db, int64_t N,
                             int64_t C) {
  // Each block cut into pieces of about 32 KiB of dx, which live in a thread-private buffer from
  // the moment they are written to their add into acc.
  const int64_t piece = std::max<int64_t>(1, (int64_t{1} << 13) / std::max<int64_t>(1, C));
  backward_blocks(dw, db, N, C, [&](int64_t r0, int64_t r1, float* pdw, float* pdb) {
    static thread_local std::vector<float> buf;
    if (buf.size() < static_cast<size_t>(piece * C)) buf.resize(static_cast<size_t>(piece * C));
    for (int64_t s = r0; s < r1; s += piece) {
      const int64_t n = std::min(r1, s + piece) - s;
      backward_block(dy + s * C, x + s * C, w, mean + s, rstd + s, buf.data(), pdw, pdb, 0, n, C,
                     s == r0);
      accumulate(acc + s * C, buf.data(), n * C);
    }
  });
}

void rms_norm_forward(const float* x, const float* w, float* y, float* rstd, int64_t N, int64_t C,
                      float eps) {
  if (N <= 0 || C <= 0) return;
#pragma omp parallel if (N * C >= kMinParallel && N > 1)
  {
    int64_t r0, r1;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
    if (r0 < r1) rms_forward_rows(x, w, y, rstd, r0, r1, C, eps);
  }
}

void rms_norm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                       float* dx, float* dw, int64_t N, int64_t C) {
  backward_blocks(dw, nullptr, N, C, [&](int64_t r0, int64_t r1, float* pdw, float*) {
    rms_backward_block(dy, x, w, rstd, dx, pdw, r0, r1, C, true);
  });
}

}  // namespace kuai::cpu
