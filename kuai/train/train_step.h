// One optimizer step you can call: from the trainer (run_training composes it with the loader,
// metrics, checkpoints and the console), from tests, and from a Python loop. A step is k
// micro-batches of forward and backward under autocast (DDP's no_sync until the last one, so the
// bucketed all-reduce runs once, overlapped with the last backward), the fp16 scaler's unscale
// and overflow check after the all-reduce (every rank takes the same decision), the gradients'
// global norm and clip factor, the update (AdamW, or ZeRO's sharded AdamW), and zero_grad. The
// step's results stay device tensors: step() reads no device value on the host. With
// StepOptions::compile the first call captures the step and later calls replay it (compile.h);
// the micro-batches are then copied into the graph's input tensors.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kuai/amp/grad_scaler.h"
#include "kuai/compile/compile.h"
#include "kuai/core/tensor.h"
#include "kuai/data/loader.h"
#include "kuai/distributed/ddp.h"
#include "kuai/distributed/zero.h"
#include "kuai/nn/module.h"
#include "kuai/optim/optimizer.h"

namespace kuai::train {

struct StepOptions {
  int64_t accum_steps = 1;      // micro-batches per optimizer step
  DType compute = DType::kF32;  // autocast's low dtype (bf16, f16); kF32: autocast off
  float grad_clip = 1.0f;       // max global norm (the clip factor is applied inside the update)
  // Graph compilation: capture the step on its first call, replay it after (AdamW, and ZeRO with
  // its collectives and, at stage 3, its units' gathers and releases; ZeRO with offloaded masters
  // stays eager and says so through `log`).
  bool compile = false;
  compiler::PassOptions passes;
  compiler::ExecutableOptions executable;
  std::function<void(const std::string&)> log;  // compile's notices
};

struct StepOutputs {
  Tensor loss;        // () fp32: the mean loss of the step's micro-batches on this rank, detached
  Tensor grad_norm;   // () fp32: the global gradient norm before clipping
  Tensor skipped;     // () fp32, fp16 only: non-zero when the step was skipped (inf/NaN gradients)
  Tensor loss_scale;  // () fp32, fp16 only: the loss scale this step used
  // Host time when forward and backward (and DDP's reduction) were done: for the profile.
  std::chrono::steady_clock::time_point backward_done;
};

// Backward of loss * loss_scale (gradients add into .grad; a factor of 1 multiplies nothing);
// returns the loss detached, a device tensor. The factor as a one-element device tensor (the fp16
// scaler's scale / k) keeps the multiply on the device.
Tensor scaled_backward(const Tensor& loss, float loss_scale);
Tensor scaled_backward(const Tensor& loss, const Tensor& loss_scale);

class TrainStep {
 public:
  // (B, T) int32 inputs and targets -> a scalar loss (mean over tokens), recorded by autograd.
  using LossFn = std::function<Tensor(const Tensor& x, const Tensor& y)>;

  // `ddp` (several ranks) and `zero` (ZeRO's optimizer; then `opt` is it) may be null. Everything
  // must outlive the TrainStep.
  TrainStep(nn::Module& model, LossFn loss, optim::Optimizer& opt, amp::GradScaler& scaler,
            const StepOptions& options, dist::DistributedDataParallel* ddp = nullptr,
            dist::ZeroAdamW* zero = nullptr);
  ~TrainStep();
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  // One step over accum_steps micro-batches; batch_at(i) gives micro-batch i when it is needed
  // (a loader's next()), so loading overlaps the previous micro-batch's compute.
  StepOutputs step(const std::function<data::Batch(int64_t micro)>& batch_at);
  StepOutputs step(const std::vector<data::Batch>& micro_batches);

  // The compiled step (null without StepOptions::compile, or where it does not apply).
  const CompiledStep* compiled() const { return compiled_ ? &*compiled_ : nullptr; }
  // A compiled step gives its arena back until the next step: call before other work between
  // steps (evaluation), which would otherwise add its memory to the arena's. Eager: nothing.
  void release_memory() {
    if (compiled_) compiled_->release_memory();
  }
  const StepOptions& options() const { return options_; }

 private:
  StepOutputs run(const std::function<data::Batch(int64_t)>& batch_at);

  nn::Module& model_;
  LossFn loss_;
  optim::Optimizer& opt_;
  amp::GradScaler& scaler_;
  StepOptions options_;
  dist::DistributedDataParallel* ddp_;
  dist::ZeroAdamW* zero_;
  std::vector<Tensor> params_;
  std::optional<CompiledStep> compiled_;
  std::vector<Tensor> inputs_;  // compiled: (B, T) x and y per micro-batch, the graph's inputs
};

}  // namespace kuai::train
