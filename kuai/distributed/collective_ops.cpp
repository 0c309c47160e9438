// Collectives as primitives (see collective_ops.h).
#include "kuai/distributed/collective_ops.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include <fmt/format.h>

#include "kuai/core/allocator.h"
#include "kuai/core/backend.h"
#include "kuai/core/dispatch.h"

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

void Compressor::before() const {
  float v[kChunk], back[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
    for (int64_t i = 0; i < m; ++i)
      v[i] = grad[i0 + i] * inv_world + (residual != nullptr ? residual[i0 + i] : 0.0f);
    backend->convert(v, DType::kF32, wire + i0, wire_dtype, m);
    if (residual == nullptr) continue;
    backend->convert(wire + i0, wire_dtype, back, DType::kF32, m);
    for (int64_t i = 0; i < m; ++i) residual[i0 + i] = v[i] - back[i];
  }
}
void Compressor::after() const { backend->convert(wire, wire_dtype, grad, DType::kF32, n); }

std::vector<TensorSpec> ReduceScatterStart::infer(std::span<const Tensor> in) const {
  const size_t want = wire_ == DType::kF32 ? 2 : 4;
  if (in.size() != want && !(wire_ != DType::kF32 && in.size() == 5))
    throw std::invalid_argument(
        "reduce_scatter_start_: takes (bucket, shard), and with a wire dtype (wire_in, wire_out[, "
        "residual])");
  if (in[0].numel() != in[1].numel() * group_->size())
    throw std::invalid_argument("reduce_scatter_start_: the shard is not 1/world of the bucket: " +
                                in[0].str() + ", " + in[1].str());
  return {};
}
void ReduceScatterStart::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  if (slot_->work)
    throw std::logic_error(
        "reduce_scatter_start_: the previous collective of this slot is unwaited");
  if (wire_ == DType::kF32) {
    slot_->work = group_->reduce_scatter(in[0], in[1], ReduceOp::kAvg);
    return;
  }
  Backend* backend = &backend_for(in[0].device());
  const Compressor c{in[0].device_data<float>(),
                     in[2].device_data<uint16_t>(),
                     in.size() > 4 ? in[4].device_data<float>() : nullptr,
                     in[0].numel(),
                     wire_,
                     1.0f / static_cast<float>(group_->size()),
                     backend};
  const uint16_t* part = in[3].device_data<uint16_t>();
  float* into = in[1].device_data<float>();
  const int64_t m = in[1].numel();
  const DType wt = wire_;
  slot_->work = group_->reduce_scatter(
      in[2], in[3], ReduceOp::kSum, [c] { c.before(); },
      [=] { backend->convert(part, wt, into, DType::kF32, m); });
}
std::vector<Tensor> ReduceScatterStart::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                            std::span<const Tensor>,
                                            const std::vector<bool>&) const {
  throw std::logic_error("reduce_scatter_start_ has no vjp");
}

std::vector<TensorSpec> AllGatherStart::infer(std::span<const Tensor> in) const {
  if (in.size() != 2 || in[1].numel() != in[0].numel() * group_->size() ||
      in[0].dtype() != in[1].dtype())
    throw std::invalid_argument(
        "all_gather_start_: takes (in, out), out of world x in's elements and in's dtype");
  return {};
}
void AllGatherStart::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  if (slot_->work)
    throw std::logic_error("all_gather_start_: the previous collective of this slot is unwaited");
  slot_->work = group_->all_gather(in[0], in[1]);
}
std::vector<Tensor> AllGatherStart::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                        std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("all_gather_start_ has no vjp");
}

std::vector<TensorSpec> CollectiveWait::infer(std::span<const Tensor>) const { return {}; }
void CollectiveWait::eval_cpu(std::span<const Tensor>, std::span<Tensor>) const {
  const std::shared_ptr<Work> w = std::move(slot_->work);  // leaves the slot empty
  if (!w) return;
  if (!waited_) {
    w->wait();
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  w->wait();
  waited_(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}
std::vector<Tensor> CollectiveWait::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                        std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("wait_ has no vjp");
}

std::vector<TensorSpec> StorageResize::infer(std::span<const Tensor> in) const {
  if (in.size() != 1 || !in[0].has_storage() || in[0].offset() != 0 ||
      static_cast<size_t>(in[0].nbytes()) != in[0].storage()->nbytes)
    throw std::invalid_argument(fmt::format("{}: takes one tensor over its whole storage", name()));
  return {};
}
void StorageResize::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  Storage& s = *in[0].storage();
  if (materialize_) {
    const MemoryUseScope parameters(MemoryUse::kParameters);
    s.materialize();
  } else {
    s.release();
  }
}
std::vector<Tensor> StorageResize::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                       std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error(std::string(name()) + " has no vjp");
}

std::shared_ptr<WorkSlot> reduce_scatter_start(const std::shared_ptr<ProcessGroup>& group,
                                               std::vector<Tensor> tensors, DType wire) {
  auto slot = std::make_shared<WorkSlot>();
  dispatch(std::make_shared<ReduceScatterStart>(group, slot, wire), std::move(tensors));
  return slot;
}

std::shared_ptr<WorkSlot> all_gather_start(const std::shared_ptr<ProcessGroup>& group,
                                           const Tensor& in, const Tensor& out) {
  auto slot = std::make_shared<WorkSlot>();
  dispatch(std::make_shared<AllGatherStart>(group, slot), {in, out});
  return slot;
}

void collective_wait(const std::shared_ptr<WorkSlot>& slot, std::vector<Tensor> tensors,
                     std::function<void(double)> waited) {
  dispatch(std::make_shared<CollectiveWait>(slot, std::move(waited)), std::move(tensors));
}

void all_gather(const std::shared_ptr<ProcessGroup>& group, const Tensor& in, const Tensor& out) {
  collective_wait(all_gather_start(group, in, out), {in, out});
}

void all_reduce(const std::shared_ptr<ProcessGroup>& group, const Tensor& t, ReduceOp op) {
  auto slot = std::make_shared<WorkSlot>();
  dispatch(std::make_shared<AllReduceStart>(group, op, slot), {t});
  collective_wait(slot, {t});
}

}  // namespace kuai::dist
