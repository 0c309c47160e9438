// Naive double-precision oracle for softmax forward/backward over the last axis, with the scale
// and the causal mask (row r is query r % cols; columns j > r % cols get 0).
#include <cmath>
#include <cstdint>
#include <vector>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {

// x, y (rows, cols).
void softmax_forward(const float* x, float* y, int64_t rows, int64_t cols, float scale,
                     bool causal) {
  std::vector<double> e(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    const int64_t len = causal ? r % cols + 1 : cols;
    double mx = -INFINITY;
    for (int64_t j = 0; j < len; ++j) mx = std::fmax(mx, static_cast<double>(scale) * xr[j]);
    double sum = 0.0;
    for (int64_t j = 0; j < len; ++j) {
      e[j] = std::exp(static_cast<double>(scale) * xr[j] - mx);
      sum += e[j];
    }
    for (int64_t j = 0; j < cols; ++j)
      y[r * cols + j] = j < len ? static_cast<float>(e[j] / sum) : 0.0f;
  }
}

// y, dy, dx (rows, cols): dx = scale * y * (dy - sum(y * dy)).
void softmax_backward(const float* y, const float* dy, float* dx, int64_t rows, int64_t cols,
                      float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * cols;
    const float* dyr = dy + r * cols;
    double dot = 0.0;
    for (int64_t j = 0; j < cols; ++j) dot += static_cast<double>(yr[j]) * dyr[j];
    for (int64_t j = 0; j < cols; ++j)
      dx[r * cols + j] = static_cast<float>(static_cast<double>(scale) * yr[j] * (dyr[j] - dot));
  }
}

}  // namespace kuai::cpu::ref
