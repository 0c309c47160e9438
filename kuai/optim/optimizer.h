// Optimizers update parameters from their .grad in place, outside autograd. Parameters come in
// groups with their own weight decay (the usual split: decay on matmul weights, none on biases,
// LayerNorm and embeddings). step(grad_scale) multiplies every gradient by grad_scale inside the
// same pass: that is how global-norm clipping costs no extra pass over the gradients. The update
// of each tensor is an in-place primitive (kuai/core/ops.h: adamw_update_, sgd_update_)
// dispatched like any op, so a dispatch mode (graph capture) sees the optimizer step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kuai/core/tensor.h"

namespace kuai::optim {

struct ParamGroup {
  std::vector<Tensor> params;
  float weight_decay = 0.0f;
};

class Optimizer {
 public:
  explicit Optimizer(std::vector<ParamGroup> groups);
  virtual ~Optimizer() = default;
  void step(float grad_scale = 1.0f);
  // grad_scale as a one-element device tensor (a clip factor computed on the device): the update
  // reads it where it runs, so the host never waits for it.
  void step(const Tensor& grad_scale);
  // The same, skipped entirely (parameters, moments and the step count untouched) when the
  // one-element fp32 device flag `skip_if` is not 0: the fp16 scaler's found_inf. The flag is an
  // input of the update primitives, which skip themselves, and of the step count's advance, so
  // the host never reads it (PyTorch's fused Adam takes found_inf the same way).
  void step(const Tensor& grad_scale, const Tensor& skip_if);
  void zero_grad();  // gradients to none
  // The learning rate is a one-element device tensor the updates read (a compiled step reads
  // the value set before it); set_lr writes it.
  void set_lr(float lr);
  float lr() const { return lr_; }
  const Tensor& lr_tensor() const { return lr_tensor_; }
  const std::vector<ParamGroup>& groups() const { return groups_; }
  // The number of steps taken (skipped ones not counted): a device value, read here (checkpoints
  // and tests; counted as a host read).
  int64_t step_count() const;
  void set_step_count(int64_t step);  // restoring a checkpoint
  const Tensor& step_tensor() const { return step_; }
  // For a captured step (compile): every tensor of optimizer state a step reads and writes, made
  // now (state made inside a capture would be made anew by each replay). nullopt: this
  // optimizer's steps are not captured (the step runs eager).
  virtual std::optional<std::vector<Tensor>> capture_state() { return std::nullopt; }
  // The per-parameter state by name, allocated now if the first step has not (AdamW: "exp_avg",
  // "exp_avg_sq"; SGD with momentum: "momentum_buffer"), each per group and parameter as groups()
  // holds them: what a state dict saves, and what loading one writes into in place.
  struct NamedState {
    std::string name;
    std::vector<std::vector<Tensor>>* tensors = nullptr;
  };
  virtual std::vector<NamedState> named_state() { return {}; }

 protected:
  // The step itself: advance the count unless skip, then update every tensor. grad_scale and
  // skip are one-element float32 tensors on the parameters' device.
  virtual void update(const Tensor& grad_scale, const Tensor& skip) = 0;
  std::vector<ParamGroup> groups_;
  float lr_ = 1e-3f;  // the host's copy of what lr_tensor_ holds
  Tensor lr_tensor_;  // (1) fp32
  Tensor step_;       // (1) int64
};

}  // namespace kuai::optim
