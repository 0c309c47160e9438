// AdamW step (see adamw.h).
#include "kuai/optim/adamw.h"

#include <stdexcept>
#include <string>

#include <cmath>
#include <cstring>

#include "kuai/backend/cpu/kernels.h"
#include "kuai/core/ops.h"

namespace kuai::optim {

void Optimizer::zero_grad() {
  for (ParamGroup& g : groups_)
    for (Tensor& p : g.params) p.set_grad(Tensor());
}

void Optimizer::step(const Tensor& grad_scale) {
  if (grad_scale.device() != kCPU || grad_scale.dtype() != DType::kF32 || grad_scale.numel() != 1)
    throw std::invalid_argument("Optimizer::step: grad_scale must be a one-element float32 " +
                                std::string("CPU tensor, got ") + grad_scale.str());
  // The CPU kernels run where the value lives: this load is the device reading its own memory.
  step(grad_scale.contiguous().data<float>()[0]);
}

void Optimizer::step(const Tensor& grad_scale, const Tensor& skip_if) {
  if (skip_if.device() != kCPU || skip_if.dtype() != DType::kF32 || skip_if.numel() != 1)
    throw std::invalid_argument("Optimizer::step: skip_if must be a one-element float32 CPU " +
                                std::string("tensor, got ") + skip_if.str());
  // As for grad_scale: the update, on the CPU device, reads the flag from its own memory.
  if (skip_if.contiguous().data<float>()[0] != 0.0f) return;  // NaN too: skipped
  step(grad_scale);
}

cpu::AdamWParams adamw_params(const AdamWOptions& o, float lr, int64_t step, float grad_scale) {
  const double t = static_cast<double>(step);
  cpu::AdamWParams hp{};
  hp.lr = lr;
  hp.beta1 = o.beta1;
  hp.beta2 = o.beta2;
  hp.eps = o.eps;
  hp.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(o.beta1), t));
  hp.bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(o.beta2), t));
  hp.grad_scale = grad_scale;
  return hp;
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

void AdamW::step(float grad_scale) {
  ++step_;
  cpu::AdamWParams hp = adamw_params(opt_, lr_, step_, grad_scale);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    ParamGroup& group = groups_[gi];
    hp.weight_decay = group.weight_decay;
    if (m_[gi].empty()) ensure_state();
    for (size_t i = 0; i < group.params.size(); ++i) {
      Tensor& p = group.params[i];
      Tensor g = p.grad();
      if (!g.defined()) continue;
      g = g.contiguous();
      cpu::adamw_step(p.data<float>(), g.data<float>(), m_[gi][i].data<float>(),
                      v_[gi][i].data<float>(), p.numel(), hp);
    }
  }
}

}  // namespace kuai::optim
