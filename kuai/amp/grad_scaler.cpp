// Dynamic loss scaler (see grad_scaler.h).
#include "kuai/amp/grad_scaler.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"

namespace kuai::amp {
namespace {

// A usable scale: finite and a normal float, so that 1/scale is finite too.
bool usable_scale(float x) { return std::isfinite(x) && x >= FLT_MIN; }

// found_inf as the scaler hands it out: a one-element float32 tensor (on the scale's device;
// dispatch names a mismatch).
void check_flag(const Tensor& found_inf, const char* who) {
  if (!found_inf.defined() || found_inf.dtype() != DType::kF32 || found_inf.numel() != 1)
    throw std::invalid_argument(std::string(who) +
                                ": found_inf must be a one-element float32 tensor, got " +
                                (found_inf.defined() ? found_inf.str() : "an undefined tensor"));
}

float read_flag(const Tensor& found_inf, const char* who) {
  check_flag(found_inf, who);
  return found_inf.item_as<float>();  // the host read (free on the CPU, a sync on a GPU)
}

}  // namespace

GradScaler::GradScaler(const GradScalerOptions& options)
    : opt_(options),
      scale_(full({}, options.enabled ? options.init_scale : 1.0f)),
      tracker_(zeros({}, DType::kI64)) {
  if (!usable_scale(opt_.init_scale))
    throw std::invalid_argument("GradScaler: init_scale must be finite and >= 2^-126, got " +
                                std::to_string(opt_.init_scale));
  if (!(std::isfinite(opt_.growth_factor) && opt_.growth_factor > 1.0f))
    throw std::invalid_argument("GradScaler: growth_factor must be finite and > 1, got " +
                                std::to_string(opt_.growth_factor));
  if (!(opt_.backoff_factor > 0.0f && opt_.backoff_factor < 1.0f))
    throw std::invalid_argument("GradScaler: backoff_factor must be in (0, 1), got " +
                                std::to_string(opt_.backoff_factor));
  if (opt_.growth_interval < 1)
    throw std::invalid_argument("GradScaler: growth_interval must be >= 1, got " +
                                std::to_string(opt_.growth_interval));
}

Tensor GradScaler::unscale_(const std::vector<Tensor>& params) {
  Device device = scale_.device();
  for (const Tensor& p : params)
    if (p.defined() && p.grad().defined()) {
      device = p.grad().device();
      break;
    }
  Tensor found_inf = zeros({}, DType::kF32, device);
  if (!opt_.enabled) return found_inf;
  if (unscaled_)
    throw std::logic_error(
        "GradScaler::unscale_: already called since the last update(); the gradients would be "
        "divided by the scale twice");
  // Check every gradient before changing any, so an error leaves them all as they were.
  std::vector<std::pair<Tensor, Tensor>> grads;  // (parameter, gradient)
  for (const Tensor& p : params) {
    if (!p.defined() || !p.grad().defined()) continue;
    const Tensor g = p.grad();
    if (g.dtype() != DType::kF32 || g.device() != device)
      throw std::invalid_argument("GradScaler::unscale_: gradients must be float32 on " +
                                  device.str() + ", got " + g.str());
    grads.emplace_back(p, g);
  }
  std::vector<Tensor> contiguous_grads;
  for (auto& [p, g] : grads) {
    if (!g.is_contiguous()) {  // unscale a contiguous copy and make it the gradient
      g = g.contiguous();
      p.set_grad(g);
    }
    contiguous_grads.push_back(g);
  }
  apply_unscale(contiguous_grads, found_inf);
  return found_inf;
}

void GradScaler::apply_unscale(const std::vector<Tensor>& grads, const Tensor& found_inf) {
  unscaled_ = true;
  // One in-place primitive per gradient; the scale is read where the unscaling runs.
  for (const Tensor& g : grads) unscale_and_check_(g, scale_, found_inf);
}

Tensor GradScaler::unscale_grads_(const std::vector<Tensor>& grads) {
  Tensor found_inf = zeros({}, DType::kF32, scale_.device());
  if (!opt_.enabled) return found_inf;
  for (const Tensor& g : grads)
    if (g.device() != scale_.device() || g.dtype() != DType::kF32 || !g.is_contiguous())
      throw std::invalid_argument(
          "GradScaler::unscale_grads_: gradients must be contiguous "
          "float32 on " +
          scale_.device().str() + ", got " + g.str());
  if (unscaled_)
    throw std::logic_error(
        "GradScaler::unscale_grads_: already called since the last update(); the gradients would "
        "be divided by the scale twice");
  apply_unscale(grads, found_inf);
  return found_inf;
}

float GradScaler::scale() const {
  if (!opt_.enabled) return 1.0f;
  return scale_.item();  // counted
}

int64_t GradScaler::growth_tracker() const {
  return tracker_.item_as<int64_t>();  // counted
}

void GradScaler::step_on_device(optim::Optimizer& opt, const Tensor& found_inf,
                                const Tensor& grad_factor) {
  const Tensor factor =
      grad_factor.defined() ? grad_factor : full({}, 1.0f, DType::kF32, scale_.device());
  if (!opt_.enabled) return opt.step(factor);
  check_flag(found_inf, "GradScaler::step");
  opt.step(factor, found_inf);
}

bool GradScaler::step(optim::Optimizer& opt, const Tensor& found_inf, const Tensor& grad_factor) {
  step_on_device(opt, found_inf, grad_factor);
  return !opt_.enabled || read_flag(found_inf, "GradScaler::step") == 0.0f;  // NaN: skipped
}

void GradScaler::update(const Tensor& found_inf) {
  if (!opt_.enabled) return;
  check_flag(found_inf, "GradScaler::update");
  unscaled_ = false;
  // The update primitive: the flag, the scale and the tracker are all read and written where
  // they live (the CPU device here); the host learns nothing.
  scaler_update_(scale_, tracker_, found_inf.contiguous(), opt_.backoff_factor, opt_.growth_factor,
                 opt_.growth_interval);
}

void GradScaler::update(bool found_inf) {
  update(full({}, found_inf ? 1.0f : 0.0f, DType::kF32, scale_.device()));
}

void GradScaler::load_state(const GradScalerState& state) {
  if (!usable_scale(state.scale))
    throw std::invalid_argument("GradScaler::load_state: scale must be finite and >= 2^-126, got " +
                                std::to_string(state.scale));
  if (state.growth_tracker < 0)
    throw std::invalid_argument("GradScaler::load_state: growth_tracker must be >= 0, got " +
                                std::to_string(state.growth_tracker));
  scale_.copy_from_host(&state.scale, sizeof state.scale);
  tracker_.copy_from_host(&state.growth_tracker, sizeof state.growth_tracker);
  unscaled_ = false;
}

}  // namespace kuai::amp
