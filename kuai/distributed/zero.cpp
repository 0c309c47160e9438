// ZeRO stages 1 and 2 (see zero.h).
#include "kuai/distributed/zero.h"

#include "kuai/core/allocator.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <map>
#include <stdexcept>

#include "kuai/core/ops.h"
#include "kuai/optim/offload_update.h"

namespace kuai::dist {

ZeroAdamW::ZeroAdamW(std::vector<optim::ParamGroup> groups, const optim::AdamWOptions& options,
                     std::shared_ptr<ProcessGroup> group, std::vector<std::vector<Tensor>> buckets,
                     int stage, int64_t gather_chunk, std::optional<optim::OffloadOptions> offload)
    : Optimizer(std::move(groups)),
      opt_(options),
      group_(std::move(group)),
      stage_(stage),
      gather_chunk_(std::max<int64_t>(1, gather_chunk)) {
  if (stage_ != 1 && stage_ != 2)
    throw std::invalid_argument(fmt::format("ZeroAdamW: stage must be 1 or 2, got {}", stage_));
  set_lr(options.lr);
  std::map<const void*, std::pair<size_t, size_t>> where;  // parameter -> (group, index)
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (size_t i = 0; i < groups_[gi].params.size(); ++i) {
      const Tensor& p = groups_[gi].params[i];
      if (p.dtype() != DType::kF32 || !p.is_contiguous())
        throw std::invalid_argument("ZeroAdamW: parameters must be contiguous fp32");
      if (!where.emplace(p.impl(), std::pair{gi, i}).second)
        throw std::invalid_argument("ZeroAdamW: a parameter appears twice in the groups");
      total_ += p.numel();
    }
  if (buckets.empty()) {
    buckets.emplace_back();
    for (const optim::ParamGroup& g : groups_)
      for (const Tensor& p : g.params) buckets.back().push_back(p);
  }
  int64_t laid_out = 0;
  for (const auto& bucket : buckets) {
    buckets_.emplace_back();
    for (const Tensor& p : bucket) {
      auto it = where.find(p.impl());
      if (it == where.end())
        throw std::invalid_argument("ZeroAdamW: a bucket holds a parameter the groups do not");
      buckets_.back().push_back({it->second.first, it->second.second, p.numel()});
      where.erase(it);  // each parameter once
      laid_out += p.numel();
    }
  }
  if (!where.empty() || laid_out != total_)
    throw std::invalid_argument("ZeroAdamW: the buckets do not hold every parameter once");
  const int64_t world = group_->size();
  for (const auto& bucket : buckets_) {
    int64_t n = 0;
    for (const Member& m : bucket) n += m.numel;
    part_offset_.push_back(shard_);
    part_.push_back((n + world - 1) / world);
    shard_ += part_.back();
  }
  for (int r = 0; r < group_->size(); ++r) segments_.push_back(segments_of(r));
  if (offload) {
    offloaded_ = std::make_shared<optim::OffloadedMoments>(*offload, shard_);
  } else {
    const MemoryUseScope state(MemoryUse::kOptimizer);
    m_ = zeros({std::max<int64_t>(shard_, 1)});
    v_ = zeros({std::max<int64_t>(shard_, 1)});
  }
  if (stage_ == 2) {
    const MemoryUseScope gradients(MemoryUse::kGradients);
    grad_ = zeros({std::max<int64_t>(shard_, 1)});
  }
}

std::vector<ZeroAdamW::Segment> ZeroAdamW::segments_of(int rank) const {
  std::vector<Segment> out;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const int64_t lo = rank * part_[b], hi = lo + part_[b];  // of the bucket's elements
    int64_t at = 0;  // the bucket's element where the current parameter starts
    for (const Member& m : buckets_[b]) {
      const int64_t s = std::max(lo, at), e = std::min(hi, at + m.numel);
      if (s < e) out.push_back({m.group, m.param, s - at, e - s, part_offset_[b] + (s - lo)});
      at += m.numel;
    }
  }
  return out;
}

std::vector<Tensor> ZeroAdamW::gradient_shards() const {
  if (stage_ != 2) throw std::logic_error("ZeroAdamW::gradient_shards: stage 1 keeps no shard");
  std::vector<Tensor> out;
  for (size_t b = 0; b < part_.size(); ++b)
    out.push_back(narrow(grad_, 0, part_offset_[b], part_[b]));
  return out;
}

Tensor ZeroAdamW::grad_norm_tensor() const {
  // Every rank's float64 sum of squares (its 64 bits), gathered and added in rank order.
  const Tensor mine =
      shard_ > 0 ? sum_squares_bits(narrow(grad_, 0, 0, shard_)) : zeros({1}, DType::kI64);
  Tensor all = Tensor::empty({group_->size()}, DType::kI64, grad_.device());
  group_->all_gather(mine, all)->wait();
  return norm_of_partial_sums(all);
}

Tensor ZeroAdamW::found_inf_across_ranks(const Tensor& found_inf) const {
  Tensor t = contiguous(reshape(found_inf, {1}));
  group_->all_reduce(t, ReduceOp::kSum)->wait();
  return reshape(t, {});
}

void ZeroAdamW::update(const Tensor& grad_scale, const Tensor& skip) {
  advance_step_(step_, skip);
  const Tensor hyper = adamw_hyper(step_, lr_tensor_, opt_.beta1, opt_.beta2);
  // 1. Update this rank's shard, from the full averaged gradients (stage 1) or the shard of them
  //    (stage 2): one update primitive per segment, on flat views of the parameter, its
  //    gradient and the moments.
  std::vector<optim::OffloadedAdamWUpdate::Range> ranges;  // offloaded: one update over them all
  std::vector<Tensor> ps, gs;
  for (const Segment& s : segments()) {
    const Tensor& p = groups_[s.group].params[s.param];
    if (stage_ != 2 && !p.grad().defined())
      throw std::runtime_error("ZeroAdamW: a parameter has no gradient");
    if (offloaded_) {
      ps.push_back(p);
      gs.push_back(stage_ == 2 ? grad_ : p.grad().contiguous());
      ranges.push_back({s.shard_offset, s.begin, stage_ == 2 ? s.shard_offset : s.begin, s.length,
                        groups_[s.group].weight_decay});
      continue;
    }
    const Tensor g =
        stage_ == 2 ? narrow(grad_, 0, s.shard_offset, s.length)
                    : narrow(reshape(p.grad().contiguous(), {p.numel()}), 0, s.begin, s.length);
    adamw_update_(narrow(reshape(p, {p.numel()}), 0, s.begin, s.length), g,
                  narrow(m_, 0, s.shard_offset, s.length), narrow(v_, 0, s.shard_offset, s.length),
                  hyper, grad_scale, skip, opt_.beta1, opt_.beta2, opt_.eps,
                  groups_[s.group].weight_decay);
  }
  if (offloaded_)
    optim::offloaded_adamw_update_(offloaded_, std::move(ranges), ps, gs, hyper, grad_scale, skip,
                                   opt_.beta1, opt_.beta2, opt_.eps);
  // 2. Every rank's updated shard to every rank, in chunks of at most gather_chunk_ elements per
  //    rank, so the gather buffers stay small next to the moments they save.
  const int world = group_->size();
  if (world == 1) return;
  const int64_t chunk = std::min<int64_t>(shard_, gather_chunk_);
  const MemoryUseScope comm(MemoryUse::kComm);
  Tensor send = zeros({chunk}), all = zeros({chunk * world});
  for (int64_t c0 = 0; c0 < shard_; c0 += chunk) {
    const int64_t len = std::min(chunk, shard_ - c0);
    copy_shard_range(group_->rank(), c0, len, send, 0, /*to_params=*/false);
    group_->all_gather(send, all)->wait();
    for (int r = 0; r < world; ++r)
      if (r != group_->rank()) copy_shard_range(r, c0, len, all, r * chunk, /*to_params=*/true);
  }
}

namespace {
// Elements [begin, begin + n) of a contiguous tensor as a flat view (not dispatched: the copies
// below are the optimizer's, outside autograd and capture).
Tensor flat_range(const Tensor& t, int64_t begin, int64_t n) {
  return Tensor::view_of(t, {n}, {1}, t.offset() + begin);
}
}  // namespace

void ZeroAdamW::copy_shard_range(int rank, int64_t begin, int64_t length, const Tensor& buf,
                                 int64_t buf_offset, bool to_params) {
  for (const Segment& s : segments_[rank]) {
    const int64_t b = std::max(begin, s.shard_offset);
    const int64_t e = std::min(begin + length, s.shard_offset + s.length);
    if (b >= e) continue;
    Tensor p = flat_range(groups_[s.group].params[s.param], s.begin + (b - s.shard_offset), e - b);
    Tensor x = flat_range(buf, buf_offset + (b - begin), e - b);
    if (to_params)
      p.copy_(x);
    else
      x.copy_(p);
  }
}

}  // namespace kuai::dist
