// Mixed-precision support kernels. unscale_and_check is the fp16 loss scaler's one pass over the
// gradients (PyTorch's _amp_foreach_non_finite_check_and_unscale_): it multiplies every gradient
// by 1/scale in place and raises a flag if any element is inf or NaN, so the scaler can skip the
// step. One read and one write per element, memory-bound like the optimizer step it precedes.
// The test is a bit test on the exponent (all ones: inf or NaN), which is NaN-safe without
// relying on float comparisons and reduces with an integer max, so the per-chunk loop vectorises
// (a float reduction would not without -ffast-math). OpenMP splits the array into fixed chunks;
// a chunk that finds one sets a shared atomic flag once, so the result does not depend on the
// thread count and the flag write is race-free.
#include <atomic>
#include <cstdint>
#include <cstring>

#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/parallel_chunks.h"

namespace kuai::cpu {
namespace {

// 64K floats per chunk (256 KiB): as the optimizer kernels, large enough to amortise the fork.
constexpr int64_t kChunk = int64_t{1} << 16;
constexpr uint32_t kExpMask = 0x7f800000u;  // float exponent field; all ones = inf or NaN

[[gnu::always_inline]] inline uint32_t exponent_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u & kExpMask;
}

// g (n) *= inv_scale; returns true if an element was non-finite before or after the multiply.
// Checking the input as well as the product keeps the test obviously complete whatever
// inv_scale is (an inf input times 0 is NaN, but an overflowing product has a finite input).
KUAI_KERNEL bool unscale_chunk_kernel(float* __restrict g, int64_t n, float inv_scale) {
  uint32_t worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    const float y = x * inv_scale;
    g[i] = y;
    // A max, not an OR: two finite exponents can OR to all ones (0x3f8 | 0x400).
    const uint32_t ex = exponent_bits(x), ey = exponent_bits(y);
    worst = worst > ex ? worst : ex;
    worst = worst > ey ? worst : ey;
  }
  return worst == kExpMask;
}
KUAI_CLONE(unscale_chunk, unscale_chunk_kernel)

}  // namespace

// g (n), found_inf (1).
void unscale_and_check(float* g, int64_t n, float inv_scale, float* found_inf) {
  std::atomic<bool> any{false};
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) {
    if (unscale_chunk(g + i, e - i, inv_scale)) any.store(true, std::memory_order_relaxed);
  });
  if (any.load(std::memory_order_relaxed)) *found_inf = 1.0f;
}

}  // namespace kuai::cpu
