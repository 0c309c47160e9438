// AdamW's update over offloaded moments (see offload_update.h).
#include "kuai/optim/offload_update.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "kuai/core/dispatch.h"
#include "kuai/core/primitives.h"
#include "kuai/optim/offload_adamw.h"

namespace kuai::optim {

OffloadedAdamWUpdate::OffloadedAdamWUpdate(std::shared_ptr<OffloadedMoments> moments,
                                           std::vector<Range> ranges, float beta1, float beta2,
                                           float eps)
    : moments_(std::move(moments)),
      ranges_(std::move(ranges)),
      beta1_(beta1),
      beta2_(beta2),
      eps_(eps) {
  for (size_t r = 0; r < ranges_.size(); ++r) {
    const Range& x = ranges_[r];
    if (x.first < 0 || x.length < 0 || x.first + x.length > moments_->elements() ||
        (r > 0 && x.first < ranges_[r - 1].first + ranges_[r - 1].length))
      throw std::invalid_argument(fmt::format(
          "offloaded_adamw_update: range {} ([{}, {}) of the moments) is out of order or outside "
          "the {} elements",
          r, x.first, x.first + x.length, moments_->elements()));
    if (x.master && !moments_->has_masters())
      throw std::invalid_argument(fmt::format(
          "offloaded_adamw_update: range {} updates a master, and the state has no masters file",
          r));
  }
}

std::vector<TensorSpec> OffloadedAdamWUpdate::infer(std::span<const Tensor> in) const {
  if (in.size() != 3 + 2 * ranges_.size())
    throw std::invalid_argument(
        fmt::format("offloaded_adamw_update: {} inputs for {} ranges", in.size(), ranges_.size()));
  for (size_t i = 0; i < in.size(); ++i) {
    const bool master_param = i >= 3 && (i - 3) % 2 == 0 && ranges_[(i - 3) / 2].master;
    const bool ok = master_param ? in[i].dtype() == DType::kBF16 || in[i].dtype() == DType::kF16
                                 : in[i].dtype() == DType::kF32;
    if (!ok || !in[i].is_contiguous())
      throw std::invalid_argument(
          fmt::format("offloaded_adamw_update: input {} must be a contiguous {} tensor, got {}", i,
                      master_param ? "bfloat16 or float16" : "float32", in[i].str()));
  }
  for (size_t r = 0; r < ranges_.size(); ++r) {
    const Range& x = ranges_[r];
    const Tensor &p = in[3 + 2 * r], &g = in[4 + 2 * r];
    if (x.begin < 0 || x.begin + x.length > p.numel() || x.grad_begin < 0 ||
        x.grad_begin + x.length > g.numel())
      throw std::invalid_argument(fmt::format(
          "offloaded_adamw_update: range {} ({} elements at {} / {}) is outside {} or {}", r,
          x.length, x.begin, x.grad_begin, p.str(), g.str()));
  }
  return {};
}

void OffloadedAdamWUpdate::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  if (in[2].device_data<float>()[0] != 0.0f) return;  // skipped (NaN too)
  size_t r0 = 0;                                      // the first range that may overlap the chunk
  moments_->update([&](const StateChunk& c) {
    const int64_t lo = c.first, hi = c.first + c.count;
    while (r0 < ranges_.size() && ranges_[r0].first + ranges_[r0].length <= lo) ++r0;
    for (size_t r = r0; r < ranges_.size() && ranges_[r].first < hi; ++r) {
      const Range& x = ranges_[r];
      const int64_t a = std::max(lo, x.first), b = std::min(hi, x.first + x.length);
      if (a >= b) continue;
      const int64_t off = a - x.first, n = b - a;
      const Tensor& param = in[3 + 2 * r];
      const Tensor p =
          x.master ? Tensor::borrow(c.master + (a - lo), {n}, DType::kF32)
                   : Tensor::borrow(param.device_data<float>() + x.begin + off, {n}, DType::kF32);
      const Tensor g =
          Tensor::borrow(in[4 + 2 * r].device_data<float>() + x.grad_begin + off, {n}, DType::kF32);
      const Tensor mc = Tensor::borrow(c.exp_avg + (a - lo), {n}, DType::kF32);
      const Tensor vc = Tensor::borrow(c.exp_avg_sq + (a - lo), {n}, DType::kF32);
      const std::vector<Tensor> args = {p, g, mc, vc, in[0], in[1], in[2]};
      AdamWUpdate(beta1_, beta2_, eps_, x.weight_decay).eval_cpu(args, {});
      if (x.master)  // the working copy: the updated master cast as autocast casts a weight
        cast_master_into_(p.device_data<float>(), param, x.begin + off, n);
    }
  });
}

Cost OffloadedAdamWUpdate::cost(std::span<const Tensor> in, std::span<const Tensor> out) const {
  Cost c = Primitive::cost(in, out);
  c.bytes_written = 0;
  for (size_t r = 0; r < ranges_.size(); ++r)  // the parameters
    c.bytes_written += ranges_[r].length * dtype_size(in[3 + 2 * r].dtype());
  c.disk_read = c.disk_written = moments_->file_bytes();
  return c;
}

std::vector<Tensor> OffloadedAdamWUpdate::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                              std::span<const Tensor>,
                                              const std::vector<bool>&) const {
  throw std::logic_error("offloaded_adamw_update has no gradient");
}

void offloaded_adamw_update_(const std::shared_ptr<OffloadedMoments>& moments,
                             std::vector<OffloadedAdamWUpdate::Range> ranges,
                             const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                             const Tensor& hyper, const Tensor& grad_scale, const Tensor& skip,
                             float beta1, float beta2, float eps) {
  std::vector<Tensor> in = {hyper, grad_scale, skip};
  for (size_t i = 0; i < params.size(); ++i) {
    in.push_back(params[i]);
    in.push_back(grads[i]);
  }
  dispatch(std::make_shared<OffloadedAdamWUpdate>(moments, std::move(ranges), beta1, beta2, eps),
           std::move(in));
}

}  // namespace kuai::optim
