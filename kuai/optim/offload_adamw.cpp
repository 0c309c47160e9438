// AdamW over offloaded state (see offload_adamw.h).
#include "kuai/optim/offload_adamw.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <stdexcept>

#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"
#include "kuai/optim/offload_update.h"

namespace kuai::optim {
namespace {
constexpr int64_t kAlignFloats = 16;
}

OffloadedAdamW::OffloadedAdamW(std::vector<ParamGroup> groups, const AdamWOptions& options,
                               const OffloadOptions& offload)
    : Optimizer(std::move(groups)), opt_(options) {
  set_lr(options.lr);
  const std::vector<std::vector<bool>> master = master_flags(groups_, offload, "offloaded AdamW");
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (size_t i = 0; i < groups_[gi].params.size(); ++i) {
      const Tensor& p = groups_[gi].params[i];
      if (p.dtype() != DType::kF32 || !p.is_contiguous())
        throw std::invalid_argument(
            "offloaded AdamW: parameters must be contiguous float32 tensors, got " + p.str());
      masters_ = masters_ || master[gi][i];
      elements_ = (elements_ + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
      slots_.push_back({gi, i, elements_, p.numel(), master[gi][i]});
      elements_ += p.numel();
    }
  moments_ = std::make_shared<OffloadedMoments>(offload, elements_, masters_);
  if (!masters_) return;
  // The masters into their file (the moments start at zero), then the parameters become their
  // working copies.
  size_t s0 = 0;
  moments_->write([&](const StateChunk& c) {
    for_each_slot_piece(slots_, c, s0, [&](const Slot& slot, int64_t begin, int64_t at, int64_t n) {
      if (!slot.master) return;
      const Tensor& p = groups_[slot.group].params[slot.index];
      std::memcpy(c.master + at, p.device_data<float>() + begin,
                  static_cast<size_t>(n) * sizeof(float));
    });
  });
  for (const Slot& slot : slots_)
    if (slot.master)
      keep_as_working_copy_(groups_[slot.group].params[slot.index], offload.master_dtype);
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
    ranges.push_back({slot.first, 0, 0, slot.numel, group.weight_decay, slot.master});
    params.push_back(p);
    grads.push_back(g.contiguous());
  }
  offloaded_adamw_update_(moments_, std::move(ranges), params, grads, hyper, grad_scale, skip,
                          opt_.beta1, opt_.beta2, opt_.eps);
}

void OffloadedAdamW::read_masters(const MasterFn& fn) {
  if (!masters_) return;
  size_t s0 = 0;
  moments_->read([&](const StateChunk& c) {
    for_each_slot_piece(slots_, c, s0, [&](const Slot& slot, int64_t begin, int64_t at, int64_t n) {
      if (slot.master) fn(groups_[slot.group].params[slot.index], begin, n, c.master + at);
    });
  });
}

void for_each_slot_piece(
    const std::vector<OffloadedAdamW::Slot>& slots, const StateChunk& c, size_t& s0,
    const std::function<void(const OffloadedAdamW::Slot&, int64_t, int64_t, int64_t)>& fn) {
  const int64_t lo = c.first, hi = c.first + c.count;
  while (s0 < slots.size() && slots[s0].first + slots[s0].numel <= lo) ++s0;
  for (size_t s = s0; s < slots.size() && slots[s].first < hi; ++s) {
    const int64_t a = std::max(lo, slots[s].first),
                  b = std::min(hi, slots[s].first + slots[s].numel);
    if (a < b) fn(slots[s], a - slots[s].first, a - lo, b - a);
  }
}

std::vector<std::vector<bool>> master_flags(const std::vector<ParamGroup>& groups,
                                            const OffloadOptions& offload, std::string_view who) {
  std::set<const TensorImpl*> masters;
  for (const Tensor& p : offload.master_params) masters.insert(p.impl());
  if (!masters.empty() && offload.master_dtype != DType::kBF16 &&
      offload.master_dtype != DType::kF16)
    throw std::invalid_argument(fmt::format(
        "{}: master weights are offloaded from a bfloat16 or float16 working copy, not {}", who,
        dtype_name(offload.master_dtype)));
  std::vector<std::vector<bool>> flags;
  size_t found = 0;
  for (const ParamGroup& g : groups) {
    flags.emplace_back();
    for (const Tensor& p : g.params) {
      flags.back().push_back(masters.count(p.impl()) > 0);
      found += flags.back().back();
    }
  }
  if (found != masters.size())
    throw std::invalid_argument(fmt::format(
        "{}: {} of the {} parameters whose masters are to be offloaded are not among its "
        "parameters",
        who, masters.size() - found, masters.size()));
  return flags;
}

void cast_master_into_(const float* master, const Tensor& p, int64_t begin, int64_t n) {
  const Tensor src = Tensor::borrow(const_cast<float*>(master), {n}, DType::kF32);
  std::vector<Tensor> dst = {Tensor::borrow(
      static_cast<std::byte*>(p.device_ptr()) + begin * dtype_size(p.dtype()), {n}, p.dtype())};
  Cast(p.dtype()).eval_cpu(std::span<const Tensor>(&src, 1), dst);
}

void keep_as_working_copy_(const Tensor& p, DType dtype) {
  if (!p.is_leaf() || !p.is_contiguous() || p.dtype() != DType::kF32)
    throw std::invalid_argument("keep_as_working_copy_: expected a contiguous fp32 leaf, got " +
                                p.str());
  Tensor low;
  {
    const autograd::NoGradGuard no_grad;
    const MemoryUseScope params(MemoryUse::kParameters);
    low = cast(p.detach(), dtype);  // the Cast primitive: autocast's weight cast
  }
  TensorImpl* impl = p.impl();
  impl->storage = low.impl()->storage;
  impl->dtype = dtype;
  impl->strides = low.strides();
  impl->offset = low.offset();
  impl->master_elsewhere = true;
}

}  // namespace kuai::optim
