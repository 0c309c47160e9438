// SGD step (see sgd.h).
#include "kuai/optim/sgd.h"

#include "kuai/core/ops.h"

namespace kuai::optim {

SGD::SGD(std::vector<ParamGroup> groups, const SGDOptions& options)
    : Optimizer(std::move(groups)), opt_(options) {
  lr_ = options.lr;
  buf_.resize(groups_.size());
}

void SGD::update(const Tensor& grad_scale) {
  const bool first = step_ == 0;
  ++step_;
  const Tensor hyper = from_vector(std::vector<float>{lr_, first ? 1.0f : 0.0f}, {2});
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    ParamGroup& group = groups_[gi];
    if (buf_[gi].empty())
      for (Tensor& p : group.params) buf_[gi].push_back(zeros(p.shape()));
    for (size_t i = 0; i < group.params.size(); ++i) {
      Tensor& p = group.params[i];
      Tensor g = p.grad();
      if (!g.defined()) continue;
      sgd_update_(p, g, buf_[gi][i], hyper, grad_scale, opt_.momentum, opt_.dampening,
                  group.weight_decay, opt_.nesterov);
    }
  }
}

}  // namespace kuai::optim
