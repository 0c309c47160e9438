// Softmax over the last axis of (rows, cols), forward and backward, with an optional scale
// (attention's 1/sqrt(d)) and causal mask (row r is query r % cols of a square score matrix).
// Rows are independent: OpenMP splits them into chunks, each chunk runs a KUAI_CLONE kernel. The
// forward is the usual max-subtracted three-pass form (max, exp + sum, normalise) with the
// vectorised exp of vec_math.h; row sums use fixed lanes, so results do not depend on threads.
#include <algorithm>
#include <cstdint>

#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/parallel_chunks.h"
#include "kuai/backend/cpu/vec_math.h"

namespace kuai::cpu {
namespace {

constexpr int64_t kChunk = int64_t{1} << 13;  // elements per parallel chunk (whole rows)
constexpr int kLanes = 16;                    // independent accumulators for max / sums

// Sum of the lanes in a fixed pairwise order.
[[gnu::always_inline]] inline float combine_sum(float* acc) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  return acc[0];
}

// y = softmax(scale * x) over the first len entries of one row, zeros over [len, cols); W is
// max_of's vector width (4 in the baseline copy).
template <int W>
[[gnu::always_inline]] inline void softmax_row(const float* x, float* y, int64_t len, int64_t cols,
                                               float scale) {
  // NaN in x propagates through the exp/sum below whatever the max makes of it.
  const float mx = vm::max_of<W>(x, len, scale);
  const float inv = 1.0f / vm::exp_sum(x, y, len, scale, mx);
  for (int64_t j = 0; j < len; ++j) y[j] *= inv;
  for (int64_t j = len; j < cols; ++j) y[j] = 0.0f;
}

// Rows [r0, r0 + nrows) of x, y (rows, cols).
template <int W>
KUAI_KERNEL void softmax_forward_rows_kernel(const float* x, float* y, int64_t r0, int64_t nrows,
                                             int64_t cols, float scale, bool causal) {
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const int64_t len = causal ? r % cols + 1 : cols;
    softmax_row<W>(x + r * cols, y + r * cols, len, cols, scale);
  }
}
KUAI_CLONE_WIDTHS(softmax_forward_rows, softmax_forward_rows_kernel<8>,
                  softmax_forward_rows_kernel<4>)

// dx = scale * y * (dy - sum(y * dy)) over the first len entries of rows [r0, r0 + nrows) of
// row stride ld.
KUAI_KERNEL void softmax_backward_rows_kernel(const float* y, const float* dy, float* dx,
                                              int64_t r0, int64_t nrows, int64_t len, int64_t ld,
                                              float scale) {
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const float* yr = y + r * ld;
    const float* dyr = dy + r * ld;
    float* dxr = dx + r * ld;
    float lane[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= len; j += kLanes)
      for (int k = 0; k < kLanes; ++k) lane[k] += yr[j + k] * dyr[j + k];
    for (int k = 0; j + k < len; ++k) lane[k] += yr[j + k] * dyr[j + k];
    const float dot = combine_sum(lane);
#pragma GCC ivdep
    for (j = 0; j < len; ++j) dxr[j] = scale * yr[j] * (dyr[j] - dot);
  }
}
KUAI_CLONE(softmax_backward_rows, softmax_backward_rows_kernel)

}  // namespace

// x, y (rows, cols).
void softmax_forward(const float* x, float* y, int64_t rows, int64_t cols, float scale,
                     bool causal) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t rows_per_chunk = std::max<int64_t>(1, kChunk / cols);
  parallel_chunks(rows, rows_per_chunk, [&](int64_t r, int64_t e) {
    softmax_forward_rows(x, y, r, e - r, cols, scale, causal);
  });
}

// y, dy, dx (rows, cols). Masked entries have y = 0, so their dx is 0 without a causal flag.
void softmax_backward(const float* y, const float* dy, float* dx, int64_t rows, int64_t cols,
                      float scale) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t rows_per_chunk = std::max<int64_t>(1, kChunk / cols);
  parallel_chunks(rows, rows_per_chunk, [&](int64_t r, int64_t e) {
    softmax_backward_rows(y, dy, dx, r, e - r, cols, cols, scale);
  });
}

void softmax_backward_serial(const float* y, const float* dy, float* dx, int64_t rows, int64_t len,
                             int64_t ld, float scale) {
  if (rows > 0 && len > 0) softmax_backward_rows(y, dy, dx, 0, rows, len, ld, scale);
}

}  // namespace kuai::cpu
