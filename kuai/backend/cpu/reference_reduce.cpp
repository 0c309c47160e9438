// Naive oracle for sum_axis: one double accumulator per output, rows added in order.
#include <cstdint>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {

// x (outer, n, inner) -> y (outer, inner).
void sum_axis(const float* x, float* y, int64_t outer, int64_t n, int64_t inner) {
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t j = 0; j < inner; ++j) {
      double s = 0.0;
      for (int64_t r = 0; r < n; ++r) s += x[(o * n + r) * inner + j];
      y[o * inner + j] = static_cast<float>(s);
    }
  }
}

void gelu_backward_sum(const float* x, const float* dy, float* dx, float* db, int64_t n,
                       int64_t inner) {
  gelu_backward(x, dy, dx, n * inner);
  sum_axis(dx, db, 1, n, inner);
}

}  // namespace kuai::cpu::ref
