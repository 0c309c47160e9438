// Gradient-norm clipping (see clip_grad.h).
#include "kuai/optim/clip_grad.h"

#include <cmath>

#include "kuai/backend/cpu/kernels.h"

namespace kuai::optim {

double grad_norm(const std::vector<Tensor>& params) {
  double total = 0.0;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    g = g.contiguous();
    total += cpu::sum_squares(g.data<float>(), g.numel());
  }
  return std::sqrt(total);
}

float clip_coefficient(double norm, float max_norm) {
  const double c = static_cast<double>(max_norm) / (norm + 1e-6);
  return c < 1.0 ? static_cast<float>(c) : 1.0f;
}

double clip_grad_norm_(const std::vector<Tensor>& params, float max_norm) {
  const double norm = grad_norm(params);
  const float c = clip_coefficient(norm, max_norm);
  if (c < 1.0f)
    for (const Tensor& p : params) {
      Tensor g = p.grad();
      if (g.defined() && g.is_contiguous())
        cpu::scale(g.data<float>(), c, g.data<float>(), g.numel());
    }
  return norm;
}

}  // namespace kuai::optim
