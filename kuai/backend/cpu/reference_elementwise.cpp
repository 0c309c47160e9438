// Naive double-precision oracle for the tanh GELU and its derivative, written straight from the
// formula 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). The only special case is
// x = +-inf, where the formula reads inf * 0: the limits (gelu = x or 0, gelu' = 1 or 0) are used.
#include <cmath>
#include <cstdint>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {
namespace {

constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kCubic = 0.044715;

}  // namespace

void gelu_forward(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double xi = x[i];
    if (std::isinf(xi)) {
      y[i] = xi > 0 ? x[i] : -0.0f;
      continue;
    }
    const double u = kSqrt2OverPi * (xi + kCubic * xi * xi * xi);
    y[i] = static_cast<float>(0.5 * xi * (1.0 + std::tanh(u)));
  }
}

void gelu_backward(const float* x, const float* dy, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double xi = x[i];
    double d;
    if (std::isinf(xi)) {
      d = xi > 0 ? 1.0 : 0.0;
    } else {
      const double u = kSqrt2OverPi * (xi + kCubic * xi * xi * xi);
      const double du = kSqrt2OverPi * (1.0 + 3.0 * kCubic * xi * xi);
      const double t = std::tanh(u);
      d = 0.5 * (1.0 + t) + 0.5 * xi * (1.0 - t * t) * du;
    }
    dx[i] = static_cast<float>(static_cast<double>(dy[i]) * d);
  }
}

}  // namespace kuai::cpu::ref
