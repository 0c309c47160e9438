// AdamW's update over moments offloaded to disk, as one primitive, so a dispatch mode sees it like
// the in-memory update: a captured (compiled) step replays it, `kuai plan` prices it from its cost
// (the disk bytes it moves, at the measured disk bandwidth) and runs nothing on meta tensors.
//
// (hyper (3), grad_scale (1), skip (1), p_0!, g_0, p_1!, g_1, ...): one pass over the moments'
// files (OffloadedMoments::update); range i updates elements [begin, begin + length) of the
// flattened p_i from elements [grad_begin, grad_begin + length) of g_i, with the moments' flat
// elements [first, first + length). Ranges are in the order of `first` and do not overlap. Each
// piece of a range inside one chunk is updated by the AdamWUpdate primitive's own evaluation, so
// the result is that of in-memory AdamW bit for bit (the update is elementwise). A range marked
// `master` updates the fp32 master weights in the moments' third file instead, and then writes
// their cast (the Cast primitive's own kernel, autocast's weight cast) into p_i, which is kept in
// the compute dtype (train.offload_master). Nothing is read or written when skip is not 0 (NaN
// too): a skipped step leaves parameters, masters and moments as they were.
#pragma once

#include <memory>
#include <vector>

#include "kuai/core/primitive.h"
#include "kuai/optim/offloaded_moments.h"

namespace kuai::optim {

class OffloadedAdamWUpdate final : public Primitive {
 public:
  struct Range {
    int64_t first = 0;       // in the flat moments
    int64_t begin = 0;       // of the flattened parameter
    int64_t grad_begin = 0;  // of the flattened gradient
    int64_t length = 0;
    float weight_decay = 0.0f;
    bool master = false;  // p_i is bf16/fp16; its fp32 master is in the masters file at `first`
  };
  OffloadedAdamWUpdate(std::shared_ptr<OffloadedMoments> moments, std::vector<Range> ranges,
                       float beta1, float beta2, float eps);
  std::string_view name() const override { return "offloaded_adamw_update"; }
  OpClass op_class() const override { return OpClass::kOther; }
  CastPolicy cast_policy() const override { return CastPolicy::kAsIs; }
  std::vector<TensorSpec> infer(std::span<const Tensor> in) const override;
  void eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const override;
  Cost cost(std::span<const Tensor> in, std::span<const Tensor> out) const override;
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                          std::span<const Tensor> grad_out,
                          const std::vector<bool>& needs) const override;
  bool differentiable(size_t) const override { return false; }
  bool mutates_input(size_t i) const override { return i >= 3 && (i - 3) % 2 == 0; }
  bool updates_in_place() const override { return true; }

 private:
  std::shared_ptr<OffloadedMoments> moments_;
  std::vector<Range> ranges_;
  float beta1_, beta2_, eps_;
};

// Dispatches one OffloadedAdamWUpdate over `params` and `grads` (contiguous, one per range; the
// gradients fp32, the parameters fp32 or, for a master range, the compute dtype).
void offloaded_adamw_update_(const std::shared_ptr<OffloadedMoments>& moments,
                             std::vector<OffloadedAdamWUpdate::Range> ranges,
                             const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                             const Tensor& hyper, const Tensor& grad_scale, const Tensor& skip,
                             float beta1, float beta2, float eps);

}  // namespace kuai::optim
