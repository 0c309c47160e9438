// Element access for fp32 and bf16 storage in elementwise kernels: a bf16 kernel is the fp32 one
// with a shift on load and a round-to-nearest-even on store, in registers (no widened copy in
// memory). Overloads, so one templated loop body serves both (elementwise.cpp, gated.cpp).
#pragma once

#include <cstdint>

#include "kuai/core/dtype.h"

namespace kuai::cpu {

[[gnu::always_inline]] inline float load(const float* p, int64_t i) { return p[i]; }
[[gnu::always_inline]] inline float load(const uint16_t* p, int64_t i) {
  return bf16_to_float(p[i]);
}
[[gnu::always_inline]] inline void store(float* p, int64_t i, float v) { p[i] = v; }
[[gnu::always_inline]] inline void store(uint16_t* p, int64_t i, float v) {
  p[i] = float_to_bf16(v);
}

}  // namespace kuai::cpu
