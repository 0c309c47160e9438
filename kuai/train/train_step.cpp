// One optimizer step (see train_step.h).
#include "kuai/train/train_step.h"

#include <fmt/format.h>

#include <stdexcept>

#include "kuai/amp/autocast.h"
#include "kuai/core/autograd.h"
#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"

namespace kuai::train {

Tensor scaled_backward(const Tensor& loss, float loss_scale) {
  (loss_scale == 1.0f ? loss : scale(loss, loss_scale)).backward();
  return loss.detach();
}

Tensor scaled_backward(const Tensor& loss, const Tensor& loss_scale) {
  mul(loss, loss_scale).backward();
  return loss.detach();
}

TrainStep::TrainStep(nn::Module& model, LossFn loss, optim::Optimizer& opt, amp::GradScaler& scaler,
                     const StepOptions& options, dist::DistributedDataParallel* ddp,
                     dist::ZeroAdamW* zero)
    : model_(model),
      loss_(std::move(loss)),
      opt_(opt),
      scaler_(scaler),
      options_(options),
      ddp_(ddp),
      zero_(zero),
      params_(model.parameters()) {
  if (options_.accum_steps < 1)
    throw std::invalid_argument(
        fmt::format("TrainStep: accum_steps must be >= 1, got {}", options_.accum_steps));
  if (!options_.compile) return;
  // The optimizer's state, made now (state made inside the captured step would be made anew each
  // replay); an optimizer that cannot be captured runs the whole step eager.
  std::optional<std::vector<Tensor>> state = opt_.capture_state();
  if (!state) {
    if (options_.log)
      options_.log(zero_ != nullptr
                       ? "train.compile: not applied: ZeRO with offloaded master weights is not "
                         "captured; this run is eager"
                       : "train.compile: not applied: this optimizer's steps are not captured; "
                         "this run is eager");
    return;
  }
  CompileOptions co;
  co.module = &model_;
  co.passes = options_.passes;
  co.executable = options_.executable;
  co.state = [this, opt_state = std::move(*state)] {
    std::vector<Tensor> t = opt_state;
    t.push_back(scaler_.scale_tensor());
    if (ddp_)  // DDP: the gradient buckets the captured collectives reduce (ZeRO-2: none held)
      for (const auto& b : ddp_->buckets())
        if (b.flat.defined()) t.push_back(b.flat);
    return t;
  };
  co.log = options_.log;
  // Every piece of state exists (above): the capture records the step on meta tensors and the
  // first step runs as a replay, so no step holds the eager step's memory.
  co.capture_on_meta = true;
  compiled_.emplace(kuai::compile(
      [this](const std::vector<Tensor>& in) {
        const StepOutputs s = run([&](int64_t m) {
          return data::Batch{in[static_cast<size_t>(2 * m)], in[static_cast<size_t>(2 * m + 1)]};
        });
        std::vector<Tensor> o = {s.loss, s.grad_norm};
        if (s.loss_scale.defined()) o.push_back(s.loss_scale);
        if (s.skipped.defined()) o.push_back(s.skipped);
        return o;
      },
      co));
}

TrainStep::~TrainStep() = default;

StepOutputs TrainStep::step(const std::vector<data::Batch>& micro_batches) {
  if (static_cast<int64_t>(micro_batches.size()) != options_.accum_steps)
    throw std::invalid_argument(fmt::format("TrainStep::step: {} micro-batches, accum_steps is {}",
                                            micro_batches.size(), options_.accum_steps));
  return step([&](int64_t m) { return micro_batches[static_cast<size_t>(m)]; });
}

StepOutputs TrainStep::step(const std::function<data::Batch(int64_t)>& batch_at) {
  StepScope in_step;  // host access to tensor bytes from here on is a host read
  if (!compiled_) return run(batch_at);
  // The micro-batches into the step's input tensors (the graph's inputs), then the captured step
  // replays (the first call captures it).
  const int64_t k = options_.accum_steps;
  for (int64_t m = 0; m < k; ++m) {
    const data::Batch b = batch_at(m);
    if (inputs_.empty())
      for (int64_t i = 0; i < k; ++i) {
        inputs_.push_back(Tensor::empty(b.x.shape(), b.x.dtype(), b.x.device()));
        inputs_.push_back(Tensor::empty(b.y.shape(), b.y.dtype(), b.y.device()));
      }
    inputs_[static_cast<size_t>(2 * m)].copy_(b.x);
    inputs_[static_cast<size_t>(2 * m + 1)].copy_(b.y);
  }
  const std::vector<Tensor> o = (*compiled_)(inputs_);
  StepOutputs s;
  s.loss = o[0];
  s.grad_norm = o[1];
  if (scaler_.enabled()) {
    s.loss_scale = o[2];
    s.skipped = o[3];
  }
  s.backward_done = std::chrono::steady_clock::now();
  return s;
}

StepOutputs TrainStep::run(const std::function<data::Batch(int64_t)>& batch_at) {
  const int64_t k = options_.accum_steps;
  const int world = ddp_ ? ddp_->group().size() : 1;
  Tensor loss;
  // Technique 1: autocast over every micro-batch of the step, so each weight is cast once per
  // step; the guard ends (and drops the casts) before the optimizer updates the weights.
  std::optional<amp::AutocastGuard> amp;
  if (options_.compute != DType::kF32) amp.emplace(true, options_.compute);
  // fp16: the loss factor scale / k stays on the device (computed before autocast: fp32).
  Tensor loss_factor;
  if (scaler_.enabled()) {
    autograd::NoGradGuard no_grad;
    loss_factor = scale(scaler_.scale_tensor(), 1.0f / static_cast<float>(k));
  }
  for (int64_t micro = 0; micro < k; ++micro) {
    data::Batch batch = batch_at(micro);
    if (ddp_) ddp_->prepare_backward(micro + 1 == k);  // no_sync until the last micro-batch
    const Tensor l = loss_factor.defined()
                         ? scaled_backward(loss_(batch.x, batch.y), loss_factor)
                         : scaled_backward(loss_(batch.x, batch.y), 1.0f / static_cast<float>(k));
    autograd::NoGradGuard no_grad;
    loss = loss.defined() ? add(loss, l) : l;  // summed on the device
  }
  amp.reset();
  if (ddp_) ddp_->finish_backward();  // the gradients are now the average over ranks
  StepOutputs out;
  out.backward_done = std::chrono::steady_clock::now();
  if (k > 1 || world > 1) {
    autograd::NoGradGuard no_grad;
    loss = scale(loss, 1.0f / static_cast<float>(k));
  }
  // fp16: unscale and check every gradient in one pass (after the all-reduce, once DDP is on),
  // skip the step on inf/NaN, adapt the scale. Disabled, these cost nothing.
  // ZeRO-2 and 3 hold only their shard of the averaged gradients: the overflow check and the norm
  // run there and are combined across ranks, so every rank decides alike.
  const bool sharded_grads = zero_ && zero_->stage() >= 2;
  Tensor found_inf;
  if (!sharded_grads)
    found_inf = scaler_.unscale_(params_);
  else if (scaler_.enabled())
    found_inf = zero_->found_inf_across_ranks(scaler_.unscale_grads_({zero_->gradient_shard()}));
  else
    found_inf = scaler_.unscale_grads_({});
  const Tensor norm = sharded_grads ? zero_->grad_norm_tensor() : optim::grad_norm_tensor(params_);
  if (scaler_.enabled()) {  // the scale of this step, kept for the logger (update changes it)
    autograd::NoGradGuard no_grad;
    out.loss_scale = clone(scaler_.scale_tensor());
    out.skipped = found_inf;
  }
  scaler_.step_on_device(opt_, found_inf, optim::clip_coefficient(norm, options_.grad_clip));
  scaler_.update(found_inf);
  if (ddp_)
    ddp_->zero_grad();  // the gradients stay views into the buckets
  else
    opt_.zero_grad();
  out.loss = loss;
  out.grad_norm = norm;
  return out;
}

}  // namespace kuai::train
