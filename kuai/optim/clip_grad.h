// Global gradient-norm clipping. grad_norm() is the L2 norm over every gradient (accumulated in
// double, in a fixed order); clip_coefficient() is the factor PyTorch's clip_grad_norm_ applies,
// min(1, max_norm / (norm + 1e-6)), which the optimizer folds into its pass. clip_grad_norm_()
// scales the gradients in place for callers that want PyTorch's behaviour directly.
#pragma once

#include <vector>

#include "kuai/core/tensor.h"

namespace kuai::optim {

double grad_norm(const std::vector<Tensor>& params);
float clip_coefficient(double norm, float max_norm);

// The same two on the device, for a training loop that never reads a device value on the host:
// the norm as a one-element float32 tensor, and the clip factor computed from it on the device
// (max_norm <= 0: the factor is 1). Optimizer::step(const Tensor&) takes the factor as it is.
Tensor grad_norm_tensor(const std::vector<Tensor>& params);
Tensor clip_coefficient(const Tensor& norm, float max_norm);
double clip_grad_norm_(const std::vector<Tensor>& params, float max_norm);  // returns the norm

}  // namespace kuai::optim
