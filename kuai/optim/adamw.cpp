// AdamW step (see adamw.h).
#include "kuai/optim/adamw.h"

#include <stdexcept>
#include <string>

#include <cmath>
#include <cstring>

#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"

namespace kuai::optim {

void Optimizer::zero_grad() {
  for (ParamGroup& g : groups_)
    for (Tensor& p : g.params) p.set_grad(Tensor());
}

void Optimizer::step(float grad_scale) {
  autograd::NoGradGuard no_grad;  // the views an update takes of its parameters build no graph
  update(full({1}, grad_scale));
}

void Optimizer::step(const Tensor& grad_scale) {
  if (grad_scale.device() != kCPU || grad_scale.dtype() != DType::kF32 || grad_scale.numel() != 1)
    throw std::invalid_argument("Optimizer::step: grad_scale must be a one-element float32 " +
                                std::string("CPU tensor, got ") + grad_scale.str());
  autograd::NoGradGuard no_grad;
  update(grad_scale.contiguous());  // read by the update primitives where they run
}

void Optimizer::step(const Tensor& grad_scale, const Tensor& skip_if) {
  if (skip_if.device() != kCPU || skip_if.dtype() != DType::kF32 || skip_if.numel() != 1)
    throw std::invalid_argument("Optimizer::step: skip_if must be a one-element float32 CPU " +
                                std::string("tensor, got ") + skip_if.str());
  // As for grad_scale: the update, on the CPU device, reads the flag from its own memory.
  if (skip_if.contiguous().data<float>()[0] != 0.0f) return;  // NaN too: skipped
  step(grad_scale);
}

Tensor adamw_hyper(const AdamWOptions& o, float lr, int64_t step) {
  const double t = static_cast<double>(step);
  return from_vector(
      std::vector<float>{lr,
                         static_cast<float>(1.0 - std::pow(static_cast<double>(o.beta1), t)),
                         static_cast<float>(1.0 - std::pow(static_cast<double>(o.beta2), t))},
      {3});
}

AdamW::AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options)
    : Optimizer(std::move(groups)), opt_(options) {
  lr_ = options.lr;
  m_.resize(groups_.size());
  v_.resize(groups_.size());
}

void AdamW::ensure_state() {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!m_[gi].empty()) continue;
    for (Tensor& p : groups_[gi].params) {
      m_[gi].push_back(zeros(p.shape()));
      v_[gi].push_back(zeros(p.shape()));
    }
  }
}

void AdamW::update(const Tensor& grad_scale) {
  ++step_;
  const Tensor hyper = adamw_hyper(opt_, lr_, step_);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    ParamGroup& group = groups_[gi];
    if (m_[gi].empty()) ensure_state();
    for (size_t i = 0; i < group.params.size(); ++i) {
      const Tensor& p = group.params[i];
      const Tensor g = p.grad();
      if (!g.defined()) continue;
      adamw_update_(p, g, m_[gi][i], v_[gi][i], hyper, grad_scale, opt_.beta1, opt_.beta2,
                    opt_.eps, group.weight_decay);
    }
  }
}

}  // namespace kuai::optim
