// AdamW over offloaded state (see offload_adamw.h).
#include "kuai/optim/offload_adamw.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <stdexcept>

#include "kuai/core/ops.h"
#include "kuai/optim/offload_update.h"

namespace kuai::optim {
namespace {
constexpr int64_t kAlignFloats = 16;
}

OffloadedAdamW::OffloadedAdamW(std::vector<ParamGroup> groups, const AdamWOptions& options,
                               const OffloadOptions& offload)
    : Optimizer(std::move(groups)), opt_(options) {
  set_lr(options.lr);
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (size_t i = 0; i < groups_[gi].params.size(); ++i) {
      const Tensor& p = groups_[gi].params[i];
      if (p.dtype() != DType::kF32 || !p.is_contiguous())
        throw std::invalid_argument(
            "offloaded AdamW: parameters must be contiguous float32 tensors, got " + p.str());
      elements_ = (elements_ + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
      slots_.push_back({gi, i, elements_, p.numel()});
      elements_ += p.numel();
    }
  moments_ = std::make_shared<OffloadedMoments>(offload, elements_);
}

OffloadedAdamW::~OffloadedAdamW() = default;

void OffloadedAdamW::update(const Tensor& grad_scale, const Tensor& skip) {
  advance_step_(step_, skip);
  const Tensor hyper = adamw_hyper(step_, lr_tensor_, opt_.beta1, opt_.beta2);
  std::vector<OffloadedAdamWUpdate::Range> ranges;
  std::vector<Tensor> params, grads;
  for (const Slot& slot : slots_) {
    const ParamGroup& group = groups_[slot.group];
    const Tensor& p = group.params[slot.index];
    const Tensor g = p.grad();
    if (!g.defined()) continue;  // as AdamW: no gradient, no update
    ranges.push_back({slot.first, 0, 0, slot.numel, group.weight_decay});
    params.push_back(p);
    grads.push_back(g.contiguous());
  }
  offloaded_adamw_update_(moments_, std::move(ranges), params, grads, hyper, grad_scale, skip,
                          opt_.beta1, opt_.beta2, opt_.eps);
}

void OffloadedAdamW::read_state(const ConstChunk& fn) { moments_->read(fn); }

void OffloadedAdamW::write_state(const MutableChunk& fn) { moments_->write(fn); }

}  // namespace kuai::optim
