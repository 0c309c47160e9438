// Deterministic reductions: sum over the middle axis of (outer, n, inner) (bias gradients, means)
// and the sum of squares (gradient norms for clipping). Work is cut into blocks whose boundaries
// depend only on the shape; each block's partial sum is computed by one thread in a fixed order
// with double accumulators, and partials are combined sequentially. The result is therefore
// bit-identical for any OMP_NUM_THREADS, and accurate to about one float rounding.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/parallel_chunks.h"

namespace kuai::cpu {
namespace {

constexpr int64_t kBlock = int64_t{1} << 15;  // elements per partial sum (128 KiB of floats)
constexpr int64_t kCols = 4096;   // columns per task when inner > 1 (32 KiB of double sums)
constexpr int64_t kMinRows = 64;  // rows per task at least: partials stay below 1/32 of x
constexpr int kLanes = 16;        // independent accumulators in contiguous sums

// Pairwise combination of the lane accumulators, in a fixed order.
[[gnu::always_inline]] inline double combine_lanes(double* acc) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  return acc[0];
}

// Sum of x[0, n) with kLanes interleaved accumulators: element i goes to lane i % kLanes, so the
// order of additions is fixed by n alone (the same for every ISA clone).
KUAI_KERNEL double sum_contig_kernel(const float* x, int64_t n) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += static_cast<double>(x[i + k]);
  for (int k = 0; i + k < n; ++k) acc[k] += static_cast<double>(x[i + k]);
  return combine_lanes(acc);
}
KUAI_CLONE(sum_contig, sum_contig_kernel)

KUAI_KERNEL double sum_squares_contig_kernel(const float* x, int64_t n) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const double v = static_cast<double>(x[i + k]);
      acc[k] += v * v;
    }
  }
  for (int k = 0; i + k < n; ++k) {
    const double v = static_cast<double>(x[i + k]);
    acc[k] += v * v;
  }
  return combine_lanes(acc);
}
KUAI_CLONE(sum_squares_contig, sum_squares_contig_kernel)

// acc(w) = sum over rows of x(rows, w) whose rows are `stride` floats apart; rows summed in order.
KUAI_KERNEL void sum_rows_kernel(const float* x, int64_t rows, int64_t stride, int64_t w,
                                 double* acc) {
  for (int64_t j = 0; j < w; ++j) acc[j] = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * stride;
#pragma GCC ivdep
    for (int64_t j = 0; j < w; ++j) acc[j] += static_cast<double>(xr[j]);
  }
}
KUAI_CLONE(sum_rows, sum_rows_kernel)

// y(w) = float(sum over b of partial(b, w)), blocks `stride` doubles apart, added in order.
KUAI_KERNEL void combine_blocks_kernel(const double* partial, int64_t nblk, int64_t stride,
                                       int64_t w, float* y) {
  double acc[kCols];
  for (int64_t j = 0; j < w; ++j) acc[j] = partial[j];
  for (int64_t b = 1; b < nblk; ++b) {
    const double* pb = partial + b * stride;
    for (int64_t j = 0; j < w; ++j) acc[j] += pb[j];
  }
  for (int64_t j = 0; j < w; ++j) y[j] = static_cast<float>(acc[j]);
}
KUAI_CLONE(combine_blocks, combine_blocks_kernel)

}  // namespace

// x (outer, n, inner) -> y (outer, inner).
void sum_axis(const float* x, float* y, int64_t outer, int64_t n, int64_t inner) {
  if (outer <= 0 || inner <= 0) return;
  if (n <= 0) {
    fill(y, 0.0f, outer * inner);
    return;
  }
  if (inner == 1) {
    // Each row of length n is cut into blocks of kBlock; partial (outer, nblk).
    const int64_t nblk = (n + kBlock - 1) / kBlock;
    std::vector<double> partial(outer * nblk);
    parallel_tasks(outer * nblk, outer * n > kBlock, [&](int64_t t) {
      const int64_t o = t / nblk, b = t % nblk;
      const int64_t begin = b * kBlock;
      partial[t] = sum_contig(x + o * n + begin, std::min(kBlock, n - begin));
    });
    for (int64_t o = 0; o < outer; ++o) {
      double s = 0.0;
      for (int64_t b = 0; b < nblk; ++b) s += partial[o * nblk + b];
      y[o] = static_cast<float>(s);
    }
    return;
  }
  // Tasks are (outer, row block, column chunk) tiles of about kBlock elements; partial holds one
  // double row per (outer, row block): (outer, nblk, inner). Whole rows (up to kCols) per tile
  // keep the reads contiguous, which streams ~2.5x faster than narrow column strips.
  const int64_t width = std::min(inner, kCols);
  const int64_t ncol = (inner + width - 1) / width;
  const int64_t rows_per_blk = std::max(kMinRows, kBlock / width);
  const int64_t nblk = (n + rows_per_blk - 1) / rows_per_blk;
  std::vector<double> partial(outer * nblk * inner);
  parallel_tasks(outer * nblk * ncol, outer * n * inner > kBlock, [&](int64_t t) {
    const int64_t c = t % ncol, ob = t / ncol;
    const int64_t o = ob / nblk, b = ob % nblk;
    const int64_t r0 = b * rows_per_blk, c0 = c * width;
    sum_rows(x + (o * n + r0) * inner + c0, std::min(rows_per_blk, n - r0), inner,
             std::min(width, inner - c0), partial.data() + ob * inner + c0);
  });
  // y(o, j) = partial(o, 0, j) + partial(o, 1, j) + ... in block order, per column chunk.
  parallel_tasks(outer * ncol, outer * nblk * inner > kBlock, [&](int64_t t) {
    const int64_t o = t / ncol, c0 = (t % ncol) * width;
    combine_blocks(partial.data() + o * nblk * inner + c0, nblk, inner, std::min(width, inner - c0),
                   y + o * inner + c0);
  });
}

double sum_squares(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  const int64_t nblk = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(nblk);
  parallel_tasks(nblk, nblk > 1, [&](int64_t b) {
    const int64_t begin = b * kBlock;
    partial[b] = sum_squares_contig(x + begin, std::min(kBlock, n - begin));
  });
  double s = 0.0;
  for (int64_t b = 0; b < nblk; ++b) s += partial[b];
  return s;
}

void gelu_backward_sum(const float* x, const float* dy, float* dx, float* db, int64_t n,
                       int64_t inner) {
  if (inner <= 0) return;
  if (n <= 0 || inner == 1) {
    gelu_backward(x, dy, dx, n * inner);
    sum_axis(dx, db, 1, n, inner);
    return;
  }
  // sum_axis's tiles for outer = 1: each tile's rows of dx are made by gelu_backward, then summed
  // into the tile's double partials while they are in cache.
  const int64_t width = std::min(inner, kCols);
  const int64_t ncol = (inner + width - 1) / width;
  const int64_t rows_per_blk = std::max(kMinRows, kBlock / width);
  const int64_t nblk = (n + rows_per_blk - 1) / rows_per_blk;
  std::vector<double> partial(nblk * inner);
  parallel_tasks(nblk * ncol, n * inner > kBlock, [&](int64_t t) {
    const int64_t c = t % ncol, b = t / ncol;
    const int64_t r0 = b * rows_per_blk, c0 = c * width;
    const int64_t rows = std::min(rows_per_blk, n - r0), w = std::min(width, inner - c0);
    for (int64_t r = r0; r < r0 + rows; ++r) {
      const int64_t o = r * inner + c0;
      gelu_backward_serial(x + o, dy + o, dx + o, w);
    }
    sum_rows(dx + r0 * inner + c0, rows, inner, w, partial.data() + b * inner + c0);
  });
  parallel_tasks(ncol, nblk * inner > kBlock, [&](int64_t t) {
    const int64_t c0 = t * width;
    combine_blocks(partial.data() + c0, nblk, inner, std::min(width, inner - c0), db + c0);
  });
}

}  // namespace kuai::cpu
