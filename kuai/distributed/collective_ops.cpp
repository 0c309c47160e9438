// Collectives as primitives (see collective_ops.h).
#include "kuai/distributed/collective_ops.h"

#include <stdexcept>

namespace kuai::dist {

std::vector<TensorSpec> AllReduceStart::infer(std::span<const Tensor> in) const {
  if (in.empty()) throw std::invalid_argument("all_reduce_start_: takes the tensor to reduce");
  return {};
}
void AllReduceStart::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  if (slot_->work)
    throw std::logic_error("all_reduce_start_: the previous collective of this slot is unwaited");
  slot_->work = group_->all_reduce(in[0], op_, before_, after_);
}
std::vector<Tensor> AllReduceStart::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                        std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("all_reduce_start_ has no vjp");
}

std::vector<TensorSpec> CollectiveWait::infer(std::span<const Tensor>) const { return {}; }
void CollectiveWait::eval_cpu(std::span<const Tensor>, std::span<Tensor>) const {
  const std::shared_ptr<Work> w = std::move(slot_->work);  // leaves the slot empty
  if (w) w->wait();
}
std::vector<Tensor> CollectiveWait::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                        std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("wait_ has no vjp");
}

}  // namespace kuai::dist
