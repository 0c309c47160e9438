// Naive RMSNorm (see reference.h): one row at a time in double.
#include <cmath>
#include <cstdint>
#include <vector>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {

void rms_norm_forward(const float* x, const float* w, float* y, float* rstd, int64_t N, int64_t C,
                      float eps) {
  for (int64_t r = 0; r < N; ++r) {
    const float* xr = x + r * C;
    double ss = 0;
    for (int64_t j = 0; j < C; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    const double rs = 1.0 / std::sqrt(ss / static_cast<double>(C) + eps);
    rstd[r] = static_cast<float>(rs);
    for (int64_t j = 0; j < C; ++j) y[r * C + j] = static_cast<float>(xr[j] * rs * w[j]);
  }
}

// y_j = x_j r w_j with r = (mean(x^2) + eps)^(-1/2):
// dx_j = r w_j dy_j - x_j r^3 / C sum_k w_k dy_k x_k,  dw_j = sum over rows of dy_j x_j r.
void rms_norm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                       float* dx, float* dw, int64_t N, int64_t C) {
  std::vector<double> dw_acc(static_cast<size_t>(C), 0.0);
  for (int64_t r = 0; r < N; ++r) {
    const float* xr = x + r * C;
    const float* gr = dy + r * C;
    const double rs = rstd[r];
    double dot = 0;
    for (int64_t k = 0; k < C; ++k) dot += static_cast<double>(w[k]) * gr[k] * xr[k];
    for (int64_t j = 0; j < C; ++j) {
      dx[r * C + j] = static_cast<float>(rs * w[j] * gr[j] -
                                         xr[j] * rs * rs * rs * dot / static_cast<double>(C));
      dw_acc[j] += static_cast<double>(gr[j]) * xr[j] * rs;
    }
  }
  for (int64_t j = 0; j < C; ++j) dw[j] = static_cast<float>(dw_acc[j]);
}

}  // namespace kuai::cpu::ref
