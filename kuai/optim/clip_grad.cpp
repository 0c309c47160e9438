// Gradient-norm clipping (see clip_grad.h).
#include "kuai/optim/clip_grad.h"

#include <bit>
#include <cmath>
#include <stdexcept>

#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"

namespace kuai::optim {

namespace {
std::vector<Tensor> grads_of(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const Tensor& p : params)
    if (p.grad().defined()) out.push_back(p.grad());
  return out;
}
}  // namespace

double grad_norm(const std::vector<Tensor>& params) {
  // Each tensor's float64 sum of squares (a primitive), added here in order: a host read.
  double total = 0.0;
  for (const Tensor& g : grads_of(params)) {
    int64_t bits = 0;
    sum_squares_bits(g).copy_to_host_uncounted(&bits, sizeof bits);
    total += std::bit_cast<double>(bits);
  }
  count_host_read();  // one read of all the sums
  return std::sqrt(total);
}

float clip_coefficient(double norm, float max_norm) {
  const double c = static_cast<double>(max_norm) / (norm + 1e-6);
  return c < 1.0 ? static_cast<float>(c) : 1.0f;
}

Tensor grad_norm_tensor(const std::vector<Tensor>& params) {
  return global_norm(grads_of(params));  // stays on the device
}

Tensor clip_coefficient(const Tensor& norm, float max_norm) {
  if (norm.dtype() != DType::kF32 || norm.numel() != 1)
    throw std::invalid_argument("clip_coefficient: expected a one-element float32 tensor, got " +
                                norm.str());
  return clip_factor(norm, max_norm);
}

double clip_grad_norm_(const std::vector<Tensor>& params, float max_norm) {
  const double norm = grad_norm(params);
  const float c = clip_coefficient(norm, max_norm);
  if (c < 1.0f)
    for (const Tensor& g : grads_of(params))
      if (g.is_contiguous()) scale_(g, c);
  return norm;
}

}  // namespace kuai::optim
