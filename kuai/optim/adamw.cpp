// AdamW step (see adamw.h).
#include "kuai/optim/adamw.h"

#include "kuai/core/allocator.h"

#include <stdexcept>
#include <string>

#include <cmath>
#include <cstring>

#include "kuai/core/autograd.h"
#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"

namespace kuai::optim {

Optimizer::Optimizer(std::vector<ParamGroup> groups)
    : groups_(std::move(groups)), lr_tensor_(full({1}, 1e-3f)), step_(zeros({1}, DType::kI64)) {}

void Optimizer::zero_grad() {
  for (ParamGroup& g : groups_)
    for (Tensor& p : g.params) p.set_grad(Tensor());
}

void Optimizer::set_lr(float lr) {
  lr_ = lr;
  lr_tensor_.copy_from_host(&lr, sizeof lr);  // a host-to-device write, not a read
}

int64_t Optimizer::step_count() const {
  return step_.item_as<int64_t>();  // a host read
}

void Optimizer::set_step_count(int64_t step) { step_.copy_from_host(&step, sizeof step); }

namespace {
void check_one_f32(const Tensor& t, const char* what) {
  if (t.dtype() != DType::kF32 || t.numel() != 1)
    throw std::invalid_argument(std::string("Optimizer::step: ") + what +
                                " must be a one-element float32 tensor, got " + t.str());
}
}  // namespace

void Optimizer::step(float grad_scale) {
  autograd::NoGradGuard no_grad;  // the views an update takes of its parameters build no graph
  update(full({1}, grad_scale, DType::kF32, lr_tensor_.device()),
         zeros({1}, DType::kF32, lr_tensor_.device()));
}

void Optimizer::step(const Tensor& grad_scale) {
  check_one_f32(grad_scale, "grad_scale");
  autograd::NoGradGuard no_grad;
  update(grad_scale.contiguous(),
         zeros({1}, DType::kF32,
               lr_tensor_.device()));  // read by the update primitives where they run
}

void Optimizer::step(const Tensor& grad_scale, const Tensor& skip_if) {
  check_one_f32(grad_scale, "grad_scale");
  check_one_f32(skip_if, "skip_if");
  autograd::NoGradGuard no_grad;
  update(grad_scale.contiguous(), skip_if.contiguous());
}

AdamW::AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options)
    : Optimizer(std::move(groups)), opt_(options) {
  set_lr(options.lr);
  m_.resize(groups_.size());
  v_.resize(groups_.size());
}

void AdamW::ensure_state() {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!m_[gi].empty()) continue;
    const MemoryUseScope state(MemoryUse::kOptimizer);
    for (Tensor& p : groups_[gi].params) {
      m_[gi].push_back(zeros(p.shape(), DType::kF32, p.device()));
      v_[gi].push_back(zeros(p.shape(), DType::kF32, p.device()));
    }
  }
}

void AdamW::update(const Tensor& grad_scale, const Tensor& skip) {
  advance_step_(step_, skip);
  const Tensor hyper = adamw_hyper(step_, lr_tensor_, opt_.beta1, opt_.beta2);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    ParamGroup& group = groups_[gi];
    if (m_[gi].empty()) ensure_state();
    for (size_t i = 0; i < group.params.size(); ++i) {
      const Tensor& p = group.params[i];
      const Tensor g = p.grad();
      if (!g.defined()) continue;
      adamw_update_(p, g, m_[gi][i], v_[gi][i], hyper, grad_scale, skip, opt_.beta1, opt_.beta2,
                    opt_.eps, group.weight_decay);
    }
  }
}

std::vector<Optimizer::NamedState> AdamW::named_state() {
  ensure_state();
  return {{"exp_avg", &m_}, {"exp_avg_sq", &v_}};
}

std::optional<std::vector<Tensor>> AdamW::capture_state() {
  ensure_state();
  std::vector<Tensor> t = {step_, lr_tensor_};
  for (const auto& g : m_) t.insert(t.end(), g.begin(), g.end());
  for (const auto& g : v_) t.insert(t.end(), g.begin(), g.end());
  return t;
}

}  // namespace kuai::optim
