// AdamW (Loshchilov & Hutter), with PyTorch's semantics: decoupled weight decay p *= 1 - lr·wd,
// bias-corrected moments, eps added outside the square root. One fused pass per parameter
// reads p, g, m, v and writes p, m, v: 28 bytes per parameter, the memory-bandwidth floor.
#pragma once

#include "kuai/optim/optimizer.h"

namespace kuai::optim {

struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
};

class AdamW : public Optimizer {
 public:
  AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options);
  // Moment buffers, per group and parameter (allocated at the first step).
  const std::vector<std::vector<Tensor>>& exp_avg() const { return m_; }
  const std::vector<std::vector<Tensor>>& exp_avg_sq() const { return v_; }
  // Allocates the (zero) moments now if the first step has not: checkpoints always hold them.
  void ensure_state();
  // The step count, the learning rate and the moments (ensured).
  std::optional<std::vector<Tensor>> capture_state() override;
  std::vector<NamedState> named_state() override;  // exp_avg, exp_avg_sq (ensured)

 protected:
  void update(const Tensor& grad_scale, const Tensor& skip) override;

 private:
  AdamWOptions opt_;
  std::vector<std::vector<Tensor>> m_, v_;
};

}  // namespace kuai::optim
