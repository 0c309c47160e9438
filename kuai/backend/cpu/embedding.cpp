// Embedding lookup, fp32: the forward gathers rows of the table W (V, C); the backward
// scatter-adds gradient rows into dW (V, C). The backward first links the rows of dout by token id
// (a counting pass, O(N + V)), then each thread owns a range of dW rows: it zeroes them and adds
// each used id's gradient rows in row order. No atomics, one memset of dW plus the N gradient
// rows, and the summation order is fixed by the row order of dout, so dW is bit-identical
// whatever the thread count.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"

namespace kuai::cpu {
namespace {

constexpr int64_t kMinParallel = 1 << 15;  // elements below which one thread does it all

inline void thread_range(int64_t n, int t, int nt, int64_t* begin, int64_t* end) {
  const int64_t base = n / nt, extra = n % nt;
  *begin = t * base + std::min<int64_t>(t, extra);
  *end = *begin + base + (t < extra ? 1 : 0);
}

// dW rows [v0, v1). head[v] is the first row of dout with id v (-1: none), next[i] the following
// row with the same id as row i (-1: none); both lists are in increasing row order.
KUAI_KERNEL void backward_rows_kernel(const float* dout, const int32_t* head, const int32_t* next,
                                      float* dW, int64_t v0, int64_t v1, int64_t C) {
  // One large memset first: for big tables libc streams it past the caches, which is about twice
  // as fast as zeroing the gaps between used ids one short run at a time.
  std::memset(dW + v0 * C, 0, (v1 - v0) * C * sizeof(float));
  for (int64_t v = v0; v < v1; ++v) {
    float* dst = dW + v * C;  // (C)
    for (int32_t i = head[v]; i >= 0; i = next[i]) {
      const float* src = dout + static_cast<int64_t>(i) * C;
      for (int64_t c = 0; c < C; ++c) dst[c] += src[c];
    }
  }
}
KUAI_CLONE(backward_rows, backward_rows_kernel)

}  // namespace

void embedding_forward(const float* W, const int32_t* idx, float* out, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= kMinParallel)
  for (int64_t i = 0; i < N; ++i)
    std::memcpy(out + i * C, W + static_cast<int64_t>(idx[i]) * C, C * sizeof(float));
}

void embedding_backward(const float* dout, const int32_t* idx, float* dW, int64_t N, int64_t C,
                        int64_t V) {
  if (V <= 0 || C <= 0) return;
  if (N > INT32_MAX) throw std::length_error("embedding_backward: more than 2^31 - 1 rows");
  for (int64_t i = 0; i < N; ++i)
    if (idx[i] < 0 || idx[i] >= V)
      throw std::out_of_range("embedding_backward: index " + std::to_string(idx[i]) + " at row " +
                              std::to_string(i) + " is outside [0, " + std::to_string(V) + ")");
  // Per-id linked lists of rows, built back to front so that each list runs in row order.
  std::vector<int32_t> head(V, -1), next(N);
  for (int64_t i = N - 1; i >= 0; --i) {
    next[i] = head[idx[i]];
    head[idx[i]] = static_cast<int32_t>(i);
  }
#pragma omp parallel if (V * C >= kMinParallel && V > 1)
  {
    int64_t v0, v1;
    thread_range(V, omp_get_thread_num(), omp_get_num_threads(), &v0, &v1);
    if (v0 < v1) backward_rows(dout, head.data(), next.data(), dW, v0, v1, C);
  }
}

}  // namespace kuai::cpu
