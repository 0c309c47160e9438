// Gradient-norm clipping (see clip_grad.h).
#include "kuai/optim/clip_grad.h"

#include <cmath>
#include <stdexcept>

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

Tensor grad_norm_tensor(const std::vector<Tensor>& params) {
  // CPU device: the kernel's result lands in device (= host) memory; an accelerator would run
  // the reduction there and leave the number on the device.
  Tensor out = Tensor::empty({}, DType::kF32);
  out.data<float>()[0] = static_cast<float>(grad_norm(params));
  return out;
}

Tensor clip_coefficient(const Tensor& norm, float max_norm) {
  if (norm.device() != kCPU || norm.dtype() != DType::kF32 || norm.numel() != 1)
    throw std::invalid_argument(
        "clip_coefficient: expected a one-element float32 CPU tensor, got " + norm.str());
  Tensor out = Tensor::empty({}, DType::kF32);
  const float n = norm.contiguous().data<float>()[0];  // a device-side read (CPU device)
  out.data<float>()[0] = max_norm > 0 ? clip_coefficient(static_cast<double>(n), max_norm) : 1.0f;
  return out;
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
