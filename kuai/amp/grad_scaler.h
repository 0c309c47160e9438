// Dynamic loss scaling for fp16 mixed-precision training, with the semantics of PyTorch's
// torch.amp.GradScaler. fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The
// trainer multiplies the loss by the scale before backward, so the gradients are scale× larger
// and stay representable; unscale_() divides them back in one fused pass that also looks for
// inf/NaN (an fp16 overflow). step() then runs the optimizer only if none was found, and update()
// adapts the scale: halve it after an overflow, double it after growth_interval clean steps in a
// row. The scale, the tracker and the overflow flag stay on the device throughout: a step reads
// none of them on the host.
//
//   scaled loss:  backward(mul(loss, scaler.scale_tensor()))   (every micro-batch)
//   per step:     Tensor inf = scaler.unscale_(params);        (after all-reduce, see below)
//                 Tensor c = optim::clip_coefficient(optim::grad_norm_tensor(params), clip);
//                 scaler.step_on_device(opt, inf, c); scaler.update(inf); opt.zero_grad();
//
// PyTorch equivalence: scale() = get_scale(), unscale_ = unscale_ (grads *= 1/scale, found_inf
// via _amp_foreach_non_finite_check_and_unscale_), step = step (skipped when found_inf != 0),
// update = update (_amp_update_scale_: backoff on inf, growth after growth_interval good steps,
// growth refused when the grown scale would not be finite in fp32), state = state_dict's
// scale and _growth_tracker. Differences: unscale_ takes the parameters rather than the
// optimizer, and step takes the found_inf flag and the clip factor explicitly, so clipping on the
// unscaled gradients is folded into the optimizer's pass (Optimizer::step(const Tensor&)).
//
// Why the check runs after the gradient all-reduce: each rank's local gradients can overflow
// differently, and a rank that skipped while another stepped would leave the replicas apart for
// good. Checking the reduced gradients, which every rank holds identically, gives every rank the
// same found_inf and so the same skip/step decision and the same next scale, with no extra
// collective. (An overflow on any rank makes the reduced sum inf/NaN, so nothing is missed.) With
// gradient accumulation, unscale_ likewise runs once per optimizer step, after the last
// micro-batch, on the accumulated gradients.
//
// Why bf16 needs no scaler: bf16 keeps fp32's 8-bit exponent (range ~1e-38 .. 3e38), so
// gradients neither underflow nor overflow where fp32 would not; only fp16's narrow range needs
// the scale. Construct the scaler with enabled = false for bf16 and fp32 runs: every call then
// costs nothing and the loop stays the same.
#pragma once

#include <cstdint>
#include <vector>

#include "kuai/core/tensor.h"
#include "kuai/optim/optimizer.h"

namespace kuai::amp {

struct GradScalerOptions {
  float init_scale = 65536.0f;  // 2^16
  float growth_factor = 2.0f;   // > 1
  float backoff_factor = 0.5f;  // in (0, 1)
  int64_t growth_interval = 2000;
  bool enabled = true;
};

// What a checkpoint keeps of the scaler (the options come from the config).
struct GradScalerState {
  float scale;
  int64_t growth_tracker;  // clean steps in a row since the last growth or backoff
};

class GradScaler {
 public:
  explicit GradScaler(const GradScalerOptions& options = {});

  bool enabled() const { return opt_.enabled; }
  // The scale and the growth tracker live on the device, where unscale_, step and update read and
  // change them, so a training step never reads them on the host (technique 10). scale_tensor():
  // the factor to multiply the loss by before backward, a one-element fp32 tensor that update()
  // changes in place (1 when disabled); copy it to keep the value of a step.
  const Tensor& scale_tensor() const { return scale_; }
  // The same read on the host: a host read each (core/host_reads.h), for tests, checkpoints and
  // reports, not for the step loop.
  float scale() const;
  int64_t growth_tracker() const;

  // One fused pass over every defined .grad of params (fp32 leaves; undefined grads skipped):
  // grad *= 1/scale in place, and a check for inf/NaN. Returns found_inf, a one-element fp32
  // tensor (1 or 0) on the gradients' device; nothing is read on the host. Call it once per
  // optimizer step: after the last micro-batch of gradient accumulation and after the gradient
  // all-reduce, so every rank sees the same gradients and decides alike. Calling it twice before
  // update() throws (the gradients would be divided twice). Disabled: returns a zero flag and
  // touches nothing.
  Tensor unscale_(const std::vector<Tensor>& params);
  // The same over gradient tensors themselves (contiguous fp32), for gradients that live apart
  // from their parameters: ZeRO-2's shard. Its found_inf covers this rank's shard only; combine it
  // across ranks (ZeroAdamW::found_inf_across_ranks) before step() and update().
  Tensor unscale_grads_(const std::vector<Tensor>& grads);

  // Runs opt.step(grad_factor, found_inf) (the clip factor; undefined means 1): the optimizer
  // skips itself on the device when found_inf is not 0, as PyTorch's fused Adam does, so nothing
  // is read on the host. A skipped step touches nothing: parameters, optimizer moments and the
  // optimizer's step count stay as they were. Disabled: always steps.
  void step_on_device(optim::Optimizer& opt, const Tensor& found_inf,
                      const Tensor& grad_factor = Tensor());
  // The same, then returns whether it stepped: one host read of found_inf (PyTorch's step makes
  // the same .item() call). For callers that want the answer; the trainer does not.
  bool step(optim::Optimizer& opt, const Tensor& found_inf, const Tensor& grad_factor = Tensor());

  // Adapts the scale after step(), on the device: on inf/NaN scale *= backoff_factor and the
  // growth tracker resets; otherwise the tracker counts up and at growth_interval scale *=
  // growth_factor and the tracker resets. The scale stays finite and positive in fp32: growth
  // that would overflow to inf is refused (as in PyTorch's _amp_update_scale_; the tracker still
  // resets), and backoff stops at the smallest normal float (2^-126; PyTorch would reach 0 after
  // ~150 backoffs in a row and then divide by zero). Disabled: no-op.
  void update(const Tensor& found_inf);
  void update(bool found_inf);

  GradScalerState state() const { return {scale(), growth_tracker()}; }  // host reads
  // Throws std::invalid_argument on a scale that is not finite and >= 2^-126 (the options'
  // init_scale likewise) or on a negative tracker.
  void load_state(const GradScalerState& state);

 private:
  // grads *= 1/scale (contiguous fp32, checked), inf/NaN into found_inf; marks them unscaled.
  void apply_unscale(const std::vector<Tensor>& grads, const Tensor& found_inf);

  GradScalerOptions opt_;
  Tensor scale_;           // (1) fp32, on the device
  Tensor tracker_;         // (1) int64, on the device
  bool unscaled_ = false;  // unscale_ ran since the last update()
};

}  // namespace kuai::amp
