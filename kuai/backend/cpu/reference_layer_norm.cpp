// Naive LayerNorm oracle for the tests: plain loops, double arithmetic, biased variance.
#include <cmath>
#include <cstdint>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {

void layer_norm_forward(const float* x, const float* w, const float* b, float* y, float* mean,
                        float* rstd, int64_t N, int64_t C, float eps) {
  for (int64_t i = 0; i < N; ++i) {
    const float* xr = x + i * C;  // (C)
    double m = 0.0;
    for (int64_t c = 0; c < C; ++c) m += xr[c];
    m /= static_cast<double>(C);
    double var = 0.0;
    for (int64_t c = 0; c < C; ++c) var += (xr[c] - m) * (xr[c] - m);
    var /= static_cast<double>(C);
    const double rs = 1.0 / std::sqrt(var + static_cast<double>(eps));
    for (int64_t c = 0; c < C; ++c)
      y[i * C + c] = static_cast<float>((xr[c] - m) * rs * w[c] + b[c]);
    mean[i] = static_cast<float>(m);
    rstd[i] = static_cast<float>(rs);
  }
}

void layer_norm_backward(const float* dy, const float* x, const float* w, const float* mean,
                         const float* rstd, float* dx, float* dw, float* db, int64_t N, int64_t C) {
  for (int64_t c = 0; c < C; ++c) {
    double sw = 0.0, sb = 0.0;
    for (int64_t i = 0; i < N; ++i) {
      const double xhat = (static_cast<double>(x[i * C + c]) - mean[i]) * rstd[i];
      sw += dy[i * C + c] * xhat;
      sb += dy[i * C + c];
    }
    dw[c] = static_cast<float>(sw);
    db[c] = static_cast<float>(sb);
  }
  for (int64_t i = 0; i < N; ++i) {
    // dxhat = dy * w; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).
    double m1 = 0.0, m2 = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (static_cast<double>(x[i * C + c]) - mean[i]) * rstd[i];
      const double dxhat = static_cast<double>(dy[i * C + c]) * w[c];
      m1 += dxhat;
      m2 += dxhat * xhat;
    }
    m1 /= static_cast<double>(C);
    m2 /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (static_cast<double>(x[i * C + c]) - mean[i]) * rstd[i];
      const double dxhat = static_cast<double>(dy[i * C + c]) * w[c];
      dx[i * C + c] = static_cast<float>(rstd[i] * (dxhat - m1 - xhat * m2));
    }
  }
}

void add_layer_norm_forward(const float* a, const float* b, float* x, const float* w,
                            const float* bias, float* y, float* mean, float* rstd, int64_t N,
                            int64_t C, float eps) {
  for (int64_t i = 0; i < N * C; ++i) x[i] = a[i] + b[i];
  layer_norm_forward(x, w, bias, y, mean, rstd, N, C, eps);
}

}  // namespace kuai::cpu::ref
