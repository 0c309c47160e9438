// Naive double-precision oracles for the AdamW and SGD steps, written as in the PyTorch
// documentation of torch.optim.AdamW and torch.optim.SGD (states kept in float between steps).
#include <cmath>
#include <cstdint>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {

// p, g, m, v (n).
void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamWParams& hp) {
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2;
  for (int64_t i = 0; i < n; ++i) {
    const double gi = static_cast<double>(g[i]) * hp.grad_scale;
    double pi = static_cast<double>(p[i]) * (1.0 - lr * hp.weight_decay);
    const double mi = b1 * m[i] + (1.0 - b1) * gi;
    const double vi = b2 * v[i] + (1.0 - b2) * gi * gi;
    const double mhat = mi / hp.bias_correction1;
    const double vhat = vi / hp.bias_correction2;
    pi -= lr * mhat / (std::sqrt(vhat) + hp.eps);
    p[i] = static_cast<float>(pi);
    m[i] = static_cast<float>(mi);
    v[i] = static_cast<float>(vi);
  }
}

// p, g, buf (n); buf unused when momentum == 0.
void sgd_step(float* p, const float* g, float* buf, int64_t n, float lr, float momentum,
              float dampening, float weight_decay, bool nesterov, bool first_step,
              float grad_scale) {
  for (int64_t i = 0; i < n; ++i) {
    double d = static_cast<double>(g[i]) * grad_scale + static_cast<double>(weight_decay) * p[i];
    if (momentum != 0.0f) {
      const double b = first_step ? d
                                  : static_cast<double>(momentum) * buf[i] +
                                        (1.0 - static_cast<double>(dampening)) * d;
      buf[i] = static_cast<float>(b);
      d = nesterov ? d + static_cast<double>(momentum) * b : b;
    }
    p[i] = static_cast<float>(p[i] - static_cast<double>(lr) * d);
  }
}

}  // namespace kuai::cpu::ref
