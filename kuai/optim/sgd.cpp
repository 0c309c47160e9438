// SGD step (see sgd.h).
#include "kuai/optim/sgd.h"

#include "kuai/core/ops.h"

namespace kuai::optim {

SGD::SGD(std::vector<ParamGroup> groups, const SGDOptions& options)
    : Optimizer(std::move(groups)), opt_(options) {
  set_lr(options.lr);
  buf_.resize(groups_.size());
}

void SGD::ensure_state() {
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    if (buf_[gi].empty())
      for (Tensor& p : groups_[gi].params)
        buf_[gi].push_back(zeros(p.shape(), DType::kF32, p.device()));
}

std::vector<Optimizer::NamedState> SGD::named_state() {
  if (opt_.momentum == 0.0f) return {};
  ensure_state();
  return {{"momentum_buffer", &buf_}};
}

void SGD::update(const Tensor& grad_scale, const Tensor& skip) {
  advance_step_(step_, skip);
  ensure_state();
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    ParamGroup& group = groups_[gi];
    for (size_t i = 0; i < group.params.size(); ++i) {
      Tensor& p = group.params[i];
      Tensor g = p.grad();
      if (!g.defined()) continue;
      sgd_update_(p, g, buf_[gi][i], step_, lr_tensor_, grad_scale, skip, opt_.momentum,
                  opt_.dampening, group.weight_decay, opt_.nesterov);
    }
  }
}

}  // namespace kuai::optim
