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

// The vector helpers below are always inlined into the ISA clones (see vec_math_ce.h).
#pragma GCC diagnostic ignored "-Wpsabi"

namespace kuai::cpu {
namespace {

constexpr int kLanes = 16;                 // (max, sum) pairs per row: two ce::f32x8
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
template <class F>
KUAI_CE_INLINE F neg_abs(const F& d) {
  // __builtin_bit_cast, not std::bit_cast: an out-of-line call (at -O0) would pass the vector
  // with the default ISA's ABI into an AVX clone.
  using I = decltype(d < d);  // the int32 vector of F's width
  return __builtin_bit_cast(F, __builtin_bit_cast(I, d) | INT32_MIN);  // sign bit
}

// One step of the online logsumexp, lane-wise for a vector F or on one float: max m and sum s
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

// logsumexp of one row (V), in double for the caller's loss arithmetic, on vectors F (ce::f32x8,
// or ce::f32x4 in the baseline copy: the same lanes and the same arithmetic in each).
template <class F>
KUAI_CE_INLINE double row_lse(const float* x, int64_t V) {
  // kLanes independent (max, sum) pairs, lane j at entries c + j; the scalar tail updates the
  // first lanes. -FLT_MAX rather than -inf: v - m stays a number when v = -inf (masked logits).
  constexpr int W = ce::kWidth<F>, NV = kLanes / W, H = NV / 2;  // H vectors hold 8 lanes
  F m[NV], s[NV];
  for (int q = 0; q < NV; ++q) {
    m[q] = ce::splat<F>(-FLT_MAX);
    s[q] = ce::splat<F>(0.0f);
  }
  const int64_t vv = V - V % kLanes;
  for (int64_t c = 0; c < vv; c += kLanes)
    for (int q = 0; q < NV; ++q) lse_update(ce::load<F>(x + c + q * W), m[q], s[q]);
  if (vv < V) {
    float ml[kLanes], sl[kLanes];
    for (int q = 0; q < NV; ++q) {
      ce::store(ml + q * W, m[q]);
      ce::store(sl + q * W, s[q]);
    }
    for (int64_t c = vv; c < V; ++c) lse_update(x[c], ml[c - vv], sl[c - vv]);
    for (int q = 0; q < NV; ++q) {
      m[q] = ce::load<F>(ml + q * W);
      s[q] = ce::load<F>(sl + q * W);
    }
  }
  // Merge the lanes: lane j (j < 8) with lane j + 8, then every sum rescaled to the row max.
  float mv[8];
  for (int h = 0; h < H; ++h) ce::store(mv + h * W, m[h] > m[h + H] ? m[h] : m[h + H]);
  float mx = mv[0];
  for (int j = 1; j < 8; ++j) mx = std::max(mx, mv[j]);
  double sum = 0.0;
  for (int h = 0; h < H; ++h) {
    float sv[W];
    ce::store(sv, s[h] * ce::exp_fast(m[h] - mx) + s[h + H] * ce::exp_fast(m[h + H] - mx));
    for (int j = 0; j < W; ++j) sum += sv[j];
  }
  return static_cast<double>(mx) + std::log(sum);
}

// Rows [r0, r1): lse (float) and each row's loss (0 for ignored rows).
template <class F>
KUAI_KERNEL void forward_rows_kernel(const float* logits, const int32_t* targets, float* lse,
                                     double* row_loss, int64_t r0, int64_t r1, int64_t V,
                                     int32_t ignore_index) {
  for (int64_t i = r0; i < r1; ++i) {
    const float* x = logits + i * V;  // (V)
    const double l = row_lse<F>(x, V);
    lse[i] = static_cast<float>(l);
    const int32_t t = targets[i];
    row_loss[i] = t == ignore_index ? 0.0 : l - static_cast<double>(x[t]);
  }
}
KUAI_CLONE_WIDTHS(forward_rows, forward_rows_kernel<ce::f32x8>, forward_rows_kernel<ce::f32x4>)

// Rows [r0, r1) of dlogits (N, V).
template <class F>
KUAI_KERNEL void backward_rows_kernel(const float* logits, const int32_t* targets, const float* lse,
                                      float* dlogits, int64_t r0, int64_t r1, int64_t V,
                                      int32_t ignore_index, float grad_scale) {
  constexpr int W = ce::kWidth<F>;
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
    const int64_t vw = V - V % W;
    for (int64_t c = 0; c < vw; c += W)
      ce::store(d + c, ce::exp_fast(ce::load<F>(x + c) - l) * grad_scale);
    for (int64_t c = vw; c < V; ++c) d[c] = ce::exp_fast(x[c] - l) * grad_scale;
    d[t] = (ce::exp_fast(xt - l) - 1.0f) * grad_scale;
  }
}
KUAI_CLONE_WIDTHS(backward_rows, backward_rows_kernel<ce::f32x8>, backward_rows_kernel<ce::f32x4>)

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
