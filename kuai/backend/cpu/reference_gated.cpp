// Naive SiLU and SwiGLU (see reference.h): element by element in double.
#include <cmath>
#include <cstdint>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {
namespace {
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }
double silu_grad(double x) {  // d/dx x s(x) = s + x s (1 - s)
  const double s = sigmoid(x);
  return s + x * s * (1.0 - s);
}
}  // namespace

void silu_forward(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(silu(x[i]));
}

void silu_backward(const float* x, const float* dy, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = static_cast<float>(dy[i] * silu_grad(x[i]));
}

void swiglu_forward(const float* h, float* y, int64_t rows, int64_t F) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < F; ++j)
      y[r * F + j] = static_cast<float>(silu(h[r * 2 * F + j]) * h[r * 2 * F + F + j]);
}

void swiglu_backward(const float* h, const float* dy, float* dh, int64_t rows, int64_t F) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < F; ++j) {
      const double gate = h[r * 2 * F + j], up = h[r * 2 * F + F + j], g = dy[r * F + j];
      dh[r * 2 * F + j] = static_cast<float>(g * up * silu_grad(gate));
      dh[r * 2 * F + F + j] = static_cast<float>(g * silu(gate));
    }
}

}  // namespace kuai::cpu::ref
