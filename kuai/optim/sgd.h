// SGD with momentum (PyTorch semantics: dampening, nesterov, L2 weight decay added to the
// gradient), one pass per parameter.
#pragma once

#include "kuai/optim/optimizer.h"

namespace kuai::optim {

struct SGDOptions {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<ParamGroup> groups, const SGDOptions& options);
  // momentum_buffer (ensured; none without momentum).
  std::vector<NamedState> named_state() override;

 protected:
  void update(const Tensor& grad_scale, const Tensor& skip) override;

 private:
  void ensure_state();
  SGDOptions opt_;
  std::vector<std::vector<Tensor>> buf_;
};

}  // namespace kuai::optim
