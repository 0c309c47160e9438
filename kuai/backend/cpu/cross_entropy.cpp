// Fused softmax + cross-entropy over logits (N, V), fp32, parallel over rows. The forward reads
// each row once: every lane keeps a running max and a sum of exp(x - max) rescaled whenever its
// max grows (online logsumexp, one exp per element); the lanes are merged at the end of the row.
// The loss is summed in double, in row order, so it does not depend on the thread count. The
// backward writes dlogits = (softmax - onehot) * grad_scale from the saved logsumexp.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/vec_math_ce.h"

// The f32x8 helpers below are always inlined into the ISA clones (see vec_math_ce.h).
#pragma GCC diagnostic ignored "-Wpsabi"

namespace kuai::cpu {
namespace {

constexpr int64_t kLanes = 16;             // two ce::f32x8 (max, sum) pairs per row
constexpr int64_t kMinParallel = 1 << 14;  // elements below which one thread does it all

inline void thread_range(int64_t n, int t, int nt, int64_t* begin, int64_t* end) {
  const int64_t base = n / nt, extra = n % nt;
  *begin = t * base + std::min<int64_t>(t, extra);
  *end = *begin + base + (t < extra ? 1 : 0);
}

void check_targets(const char* op, const int32_t* targets, int64_t N, int64_t V,
                   int32_t ignore_index) {
  for (int64_t i = 0; i < N; ++i) {
    const int32_t t = targets[i];
    if (t != ignore_index && (t < 0 || t >= V))
      throw std::out_of_range(std::string(op) + ": target " + std::to_string(t) + " at row " +
                              std::to_string(i) + " is outside [0, " + std::to_string(V) +
                              ") and is not ignore_index " + std::to_string(ignore_index));
  }
}

// -|d|, for a float or lane-wise.
KUAI_CE_INLINE float neg_abs(float d) { return -std::fabs(d); }
KUAI_CE_INLINE ce::f32x8 neg_abs(const ce::f32x8& d) {
  // __builtin_bit_cast, not std::bit_cast: an out-of-line call (at -O0) would pass the 32-byte
  // vector with the default ISA's ABI into an AVX clone.
  return __builtin_bit_cast(ce::f32x8, __builtin_bit_cast(ce::i32x8, d) | INT32_MIN);  // sign bit
}

// One step of the online logsumexp, lane-wise for F = ce::f32x8 or on one float: max m and sum s
// of exp(x - m) so far.
template <class F>
KUAI_CE_INLINE void lse_update(const F& v, F& m, F& s) {
  // Only one exp is needed: exp(-|v - m|) is the new term when v <= m, and the rescale factor of
  // the old sum when v > m (then the new term is exp(0) = 1).
  const F e = ce::exp_fast(neg_abs(v - m));
  const auto up = v > m;
  s = up ? s * e + 1.0f : s + e;
  m = up ? v : m;
}

// logsumexp of one row (V), in double for the caller's loss arithmetic.
KUAI_CE_INLINE double row_lse(const float* x, int64_t V) {
  // kLanes independent (max, sum) pairs: two vectors; the scalar tail updates the first lanes.
  // -FLT_MAX rather than -inf: v - m stays a number when v = -inf (masked logits).
  ce::f32x8 m0 = ce::splat<ce::f32x8>(-FLT_MAX), m1 = m0;
  ce::f32x8 s0 = ce::splat<ce::f32x8>(0.0f), s1 = s0;
  const int64_t vv = V - V % kLanes;
  for (int64_t c = 0; c < vv; c += kLanes) {
    lse_update(ce::load8(x + c), m0, s0);
    lse_update(ce::load8(x + c + 8), m1, s1);
  }
  if (vv < V) {
    float m[kLanes], s[kLanes];
    ce::store8(m, m0);
    ce::store8(m + 8, m1);
    ce::store8(s, s0);
    ce::store8(s + 8, s1);
    for (int64_t c = vv; c < V; ++c) lse_update(x[c], m[c - vv], s[c - vv]);
    m0 = ce::load8(m);
    m1 = ce::load8(m + 8);
    s0 = ce::load8(s);
    s1 = ce::load8(s + 8);
  }
  // Merge the lanes: rescale every lane's sum to the row max.
  ce::f32x8 mv = m0 > m1 ? m0 : m1;
  float mx = mv[0];
  for (int j = 1; j < 8; ++j) mx = std::max(mx, mv[j]);
  const ce::f32x8 sv = s0 * ce::exp_fast(m0 - mx) + s1 * ce::exp_fast(m1 - mx);
  double sum = 0.0;
  for (int j = 0; j < 8; ++j) sum += sv[j];
  return static_cast<double>(mx) + std::log(sum);
}

// Rows [r0, r1): lse (float) and each row's loss (0 for ignored rows).
KUAI_KERNEL void forward_rows_kernel(const float* logits, const int32_t* targets, float* lse,
                                     double* row_loss, int64_t r0, int64_t r1, int64_t V,
                                     int32_t ignore_index) {
  for (int64_t i = r0; i < r1; ++i) {
    const float* x = logits + i * V;  // (V)
    const double l = row_lse(x, V);
    lse[i] = static_cast<float>(l);
    const int32_t t = targets[i];
    row_loss[i] = t == ignore_index ? 0.0 : l - static_cast<double>(x[t]);
  }
}
KUAI_CLONE(forward_rows, forward_rows_kernel)

// Rows [r0, r1) of dlogits (N, V).
KUAI_KERNEL void backward_rows_kernel(const float* logits, const int32_t* targets, const float* lse,
                                      float* dlogits, int64_t r0, int64_t r1, int64_t V,
                                      int32_t ignore_index, float grad_scale) {
  for (int64_t i = r0; i < r1; ++i) {
    const float* x = logits + i * V;  // (V)
    float* d = dlogits + i * V;       // (V)
    const int32_t t = targets[i];
    if (t == ignore_index) {
      for (int64_t c = 0; c < V; ++c) d[c] = 0.0f;
      continue;
    }
    const float l = lse[i];
    const float xt = x[t];  // read before the row is overwritten (dlogits may alias logits)
    const int64_t v8 = V - V % 8;
    for (int64_t c = 0; c < v8; c += 8)
      ce::store8(d + c, ce::exp_fast(ce::load8(x + c) - l) * grad_scale);
    for (int64_t c = v8; c < V; ++c) d[c] = ce::exp_fast(x[c] - l) * grad_scale;
    d[t] = (ce::exp_fast(xt - l) - 1.0f) * grad_scale;
  }
}
KUAI_CLONE(backward_rows, backward_rows_kernel)

}  // namespace

double cross_entropy_forward(const float* logits, const int32_t* targets, float* lse, int64_t N,
                             int64_t V, int32_t ignore_index, int64_t* count) {
  check_targets("cross_entropy_forward", targets, N, V, ignore_index);
  if (N <= 0) {
    if (count) *count = 0;
    return 0.0;
  }
  static thread_local std::vector<double> row_loss;
  if (row_loss.size() < static_cast<size_t>(N)) row_loss.resize(N);
  double* rl = row_loss.data();
#pragma omp parallel if (N * V >= kMinParallel && N > 1)
  {
    int64_t r0, r1;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
    if (r0 < r1) forward_rows(logits, targets, lse, rl, r0, r1, V, ignore_index);
  }
  double loss = 0.0;
  int64_t n = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] == ignore_index) continue;
    loss += rl[i];
    ++n;
  }
  if (count) *count = n;
  return loss;
}

void cross_entropy_backward(const float* logits, const int32_t* targets, const float* lse,
                            float* dlogits, int64_t N, int64_t V, int32_t ignore_index,
                            float grad_scale) {
  check_targets("cross_entropy_backward", targets, N, V, ignore_index);
#pragma omp parallel if (N * V >= kMinParallel && N > 1)
  {
    int64_t r0, r1;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
    if (r0 < r1) backward_rows(logits, targets, lse, dlogits, r0, r1, V, ignore_index, grad_scale);
  }
}

double cross_entropy_forward_backward(const float* logits, const int32_t* targets, float* lse,
                                      float* dlogits, int64_t N, int64_t V, int32_t ignore_index,
                                      float grad_scale) {
  check_targets("cross_entropy_forward_backward", targets, N, V, ignore_index);
  if (N <= 0) return 0.0;
  static thread_local std::vector<double> row_loss;
  if (row_loss.size() < static_cast<size_t>(N)) row_loss.resize(N);
  double* rl = row_loss.data();
  // Blocks of about 64 KiB of logits: the forward reads them, the backward finds them in cache.
  const int64_t block = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, V));
#pragma omp parallel if (N * V >= kMinParallel && N > 1)
  {
    int64_t r0, r1;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
    for (int64_t r = r0; r < r1; r += block) {
      const int64_t e = std::min(r1, r + block);
      forward_rows(logits, targets, lse, rl, r, e, V, ignore_index);
      backward_rows(logits, targets, lse, dlogits, r, e, V, ignore_index, grad_scale);
    }
  }
  double loss = 0.0;
  for (int64_t i = 0; i < N; ++i)
    if (targets[i] != ignore_index) loss += rl[i];
  return loss;
}

}  // namespace kuai::cpu
