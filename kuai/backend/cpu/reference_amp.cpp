// Naive oracle for the loss-scale unscaling kernel: one element at a time, std::isfinite on the
// value before and after the multiply.
#include <cmath>
#include <cstdint>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {

// g (n), found_inf (1).
void unscale_and_check(float* g, int64_t n, float inv_scale, float* found_inf) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    g[i] = x * inv_scale;
    if (!std::isfinite(x) || !std::isfinite(g[i])) bad = true;
  }
  if (bad) *found_inf = 1.0f;
}

}  // namespace kuai::cpu::ref
