// Naive softmax + cross-entropy oracle for the tests: two passes per row (max, then the sum of
// exponentials) in double.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {
namespace {

void check_target(int32_t t, int64_t row, int64_t V, int32_t ignore_index) {
  if (t != ignore_index && (t < 0 || t >= V))
    throw std::out_of_range("cross_entropy: target " + std::to_string(t) + " at row " +
                            std::to_string(row) + " is outside [0, " + std::to_string(V) + ")");
}

}  // namespace

double cross_entropy_forward(const float* logits, const int32_t* targets, float* lse, int64_t N,
                             int64_t V, int32_t ignore_index, int64_t* count) {
  for (int64_t i = 0; i < N; ++i) check_target(targets[i], i, V, ignore_index);
  double loss = 0.0;
  int64_t n = 0;
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;  // (V)
    double m = -INFINITY;
    for (int64_t c = 0; c < V; ++c) m = std::fmax(m, x[c]);
    double s = 0.0;
    for (int64_t c = 0; c < V; ++c) s += std::exp(x[c] - m);
    const double l = m + std::log(s);
    lse[i] = static_cast<float>(l);
    if (targets[i] == ignore_index) continue;
    loss += l - x[targets[i]];
    ++n;
  }
  if (count) *count = n;
  return loss;
}

void cross_entropy_backward(const float* logits, const int32_t* targets, const float* lse,
                            float* dlogits, int64_t N, int64_t V, int32_t ignore_index,
                            float grad_scale) {
  for (int64_t i = 0; i < N; ++i) check_target(targets[i], i, V, ignore_index);
  for (int64_t i = 0; i < N; ++i) {
    const int32_t t = targets[i];
    for (int64_t c = 0; c < V; ++c) {
      double g = 0.0;
      if (t != ignore_index)
        g = (std::exp(static_cast<double>(logits[i * V + c]) - lse[i]) - (c == t ? 1.0 : 0.0)) *
            grad_scale;
      dlogits[i * V + c] = static_cast<float>(g);
    }
  }
}

}  // namespace kuai::cpu::ref
