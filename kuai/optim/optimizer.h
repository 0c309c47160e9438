// Optimizers update parameters from their .grad in place, outside autograd. Parameters come in
// groups with their own weight decay (the usual split: decay on matmul weights, none on biases,
// LayerNorm and embeddings). step(grad_scale) multiplies every gradient by grad_scale inside the
// same pass: that is how global-norm clipping costs no extra pass over the gradients. The update
// of each tensor is an in-place primitive (kuai/core/ops.h: adamw_update_, sgd_update_)
// dispatched like any op, so a dispatch mode (graph capture) sees the optimizer step.
#pragma once

#include <cstdint>
#include <vector>

#include "kuai/core/tensor.h"

namespace kuai::optim {

struct ParamGroup {
  std::vector<Tensor> params;
  float weight_decay = 0.0f;
};

class Optimizer {
 public:
  explicit Optimizer(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {}
  virtual ~Optimizer() = default;
  void step(float grad_scale = 1.0f);
  // grad_scale as a one-element device tensor (a clip factor computed on the device): the update
  // reads it where it runs, so the host never waits for it.
  void step(const Tensor& grad_scale);
  // The same, skipped entirely (parameters, moments and the step count untouched) when the
  // one-element fp32 device flag `skip_if` is not 0: the fp16 scaler's found_inf, read by the
  // update where it runs, so the host never reads it (PyTorch's fused Adam takes found_inf the
  // same way). On the CPU device the update runs here; a CUDA optimizer would take the flag into
  // its kernel, with its step count on the device.
  void step(const Tensor& grad_scale, const Tensor& skip_if);
  void zero_grad();  // gradients to none
  void set_lr(float lr) { lr_ = lr; }
  float lr() const { return lr_; }
  const std::vector<ParamGroup>& groups() const { return groups_; }
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t step) { step_ = step; }  // restoring a checkpoint

 protected:
  // The step itself, grad_scale a one-element float32 tensor on the parameters' device.
  virtual void update(const Tensor& grad_scale) = 0;
  std::vector<ParamGroup> groups_;
  float lr_ = 1e-3f;
  int64_t step_ = 0;
};

}  // namespace kuai::optim
