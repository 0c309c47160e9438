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

#include "kuai/core/backend.h"
#include "kuai/core/ops.h"
#include "kuai/distributed/collective_ops.h"
#include "kuai/optim/offload_adamw.h"
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
  if (stage_ < 1 || stage_ > 3)
    throw std::invalid_argument(fmt::format("ZeroAdamW: stage must be 1, 2 or 3, got {}", stage_));
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
    master_of_ = optim::master_flags(groups_, *offload, "ZeroAdamW");
    for (const auto& g : master_of_)
      for (bool m : g) masters_ = masters_ || m;
  } else {
    for (const optim::ParamGroup& g : groups_) master_of_.emplace_back(g.params.size(), false);
  }
  if (offload) {
    offloaded_ = std::make_shared<optim::OffloadedMoments>(*offload, shard_, masters_);
  } else if (stage_ < 3) {
    make_moments();
  }
  if (stage_ >= 2) {
    const MemoryUseScope gradients(MemoryUse::kGradients);
    grad_ = zeros({std::max<int64_t>(shard_, 1)});
  }
  if (stage_ == 3) {
    if (masters_)
      throw std::invalid_argument(
          "ZeroAdamW: stage 3 keeps its fp32 masters in the parameter shard; offloading them "
          "(train.offload_master) is not combined with it");
    const MemoryUseScope parameters(MemoryUse::kParameters);
    params_ = zeros({std::max<int64_t>(shard_, 1)});
    // Parameters without values here (built on meta): fill_parameter_shard makes the shard.
    bool valued = true;
    for (const optim::ParamGroup& g : groups_)
      for (const Tensor& p : g.params)
        valued = valued && (p.device().type != DeviceType::kMeta || params_.device() == p.device());
    if (shard_ > 0 && valued)
      copy_shard_range(group_->rank(), 0, shard_, params_, 0, /*to_params=*/false);
  }
  if (!masters_) return;
  // This rank's shard of the masters into its file (segments are in shard order), then every
  // rank's products' parameters become working copies.
  const std::vector<Segment>& mine = segments();
  size_t s0 = 0;
  offloaded_->write([&](const optim::StateChunk& c) {
    const int64_t lo = c.first, hi = c.first + c.count;
    while (s0 < mine.size() && mine[s0].shard_offset + mine[s0].length <= lo) ++s0;
    for (size_t i = s0; i < mine.size() && mine[i].shard_offset < hi; ++i) {
      const Segment& s = mine[i];
      if (!master_of_[s.group][s.param]) continue;
      const int64_t a = std::max(lo, s.shard_offset), b = std::min(hi, s.shard_offset + s.length);
      if (a >= b) continue;
      const Tensor& p = groups_[s.group].params[s.param];
      std::memcpy(c.master + (a - lo), p.device_data<float>() + s.begin + (a - s.shard_offset),
                  static_cast<size_t>(b - a) * sizeof(float));
    }
  });
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (size_t i = 0; i < groups_[gi].params.size(); ++i)
      if (master_of_[gi][i])
        optim::keep_as_working_copy_(groups_[gi].params[i], offload->master_dtype);
}

void ZeroAdamW::fill_parameter_shard(
    const std::function<void(const Tensor& param, int64_t begin, const Tensor& dst)>& fill) {
  if (stage_ != 3)
    throw std::logic_error("ZeroAdamW::fill_parameter_shard: only stage 3 shards the parameters");
  for (const Segment& s : segments())
    fill(groups_[s.group].params[s.param], s.begin, narrow(params_, 0, s.shard_offset, s.length));
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

std::vector<Tensor> ZeroAdamW::parameter_shards() const {
  if (stage_ != 3)
    throw std::logic_error("ZeroAdamW::parameter_shards: only stage 3 shards the parameters");
  std::vector<Tensor> out;
  for (size_t b = 0; b < part_.size(); ++b)
    out.push_back(narrow(params_, 0, part_offset_[b], part_[b]));
  return out;
}

std::vector<Tensor> ZeroAdamW::bucket(size_t b) const {
  std::vector<Tensor> out;
  for (const Member& m : buckets_.at(b)) out.push_back(groups_[m.group].params[m.param]);
  return out;
}

std::vector<Tensor> ZeroAdamW::gradient_shards() const {
  if (stage_ < 2) throw std::logic_error("ZeroAdamW::gradient_shards: stage 1 keeps no shard");
  std::vector<Tensor> out;
  for (size_t b = 0; b < part_.size(); ++b)
    out.push_back(narrow(grad_, 0, part_offset_[b], part_[b]));
  return out;
}

Tensor ZeroAdamW::grad_norm_tensor() const {
  // Every rank's float64 sum of squares (its 64 bits), gathered and added in rank order.
  const Tensor mine =
      shard_ > 0 ? sum_squares_bits(narrow(grad_, 0, 0, shard_)) : zeros({1}, DType::kI64);
  const Tensor all = zeros({group_->size()}, DType::kI64, grad_.device());
  all_gather(group_, mine, all);  // dispatched, as every collective of a step (collective_ops.h)
  return norm_of_partial_sums(all);
}

Tensor ZeroAdamW::found_inf_across_ranks(const Tensor& found_inf) const {
  Tensor t = contiguous(reshape(found_inf, {1}));
  all_reduce(group_, t, ReduceOp::kSum);
  return reshape(t, {});
}

std::optional<std::vector<Tensor>> ZeroAdamW::capture_state() {
  // Masters in a file are copied through the backend's conversions, outside the ops: not
  // captured.
  if (masters_) return std::nullopt;
  make_moments();
  std::vector<Tensor> t = {step_, lr_tensor_};
  for (const Tensor* x : {&m_, &v_, &grad_, &params_})
    if (x->defined()) t.push_back(*x);
  return t;
}

void ZeroAdamW::make_moments() {
  if (offloaded_ || m_.defined()) return;
  const MemoryUseScope state(MemoryUse::kOptimizer);
  m_ = zeros({std::max<int64_t>(shard_, 1)});
  v_ = zeros({std::max<int64_t>(shard_, 1)});
}

void ZeroAdamW::update(const Tensor& grad_scale, const Tensor& skip) {
  make_moments();
  advance_step_(step_, skip);
  const Tensor hyper = adamw_hyper(step_, lr_tensor_, opt_.beta1, opt_.beta2);
  // 1. Update this rank's shard, from the full averaged gradients (stage 1) or the shard of them
  //    (stage 2): one update primitive per segment, on flat views of the parameter, its
  //    gradient and the moments.
  std::vector<optim::OffloadedAdamWUpdate::Range> ranges;  // offloaded: one update over them all
  std::vector<Tensor> ps, gs;
  const bool sharded_grads = stage_ >= 2;
  for (const Segment& s : segments()) {
    const Tensor& p = groups_[s.group].params[s.param];
    if (!sharded_grads && !p.grad().defined())
      throw std::runtime_error("ZeroAdamW: a parameter has no gradient");
    if (offloaded_) {  // stage 3: the parameter is the shard's elements
      ps.push_back(stage_ == 3 ? params_ : p);
      gs.push_back(sharded_grads ? grad_ : p.grad().contiguous());
      ranges.push_back({s.shard_offset, stage_ == 3 ? s.shard_offset : s.begin,
                        sharded_grads ? s.shard_offset : s.begin, s.length,
                        groups_[s.group].weight_decay, master_of_[s.group][s.param]});
      continue;
    }
    const Tensor g =
        sharded_grads ? narrow(grad_, 0, s.shard_offset, s.length)
                      : narrow(reshape(p.grad().contiguous(), {p.numel()}), 0, s.begin, s.length);
    const Tensor target = stage_ == 3 ? narrow(params_, 0, s.shard_offset, s.length)
                                      : narrow(reshape(p, {p.numel()}), 0, s.begin, s.length);
    adamw_update_(target, g, narrow(m_, 0, s.shard_offset, s.length),
                  narrow(v_, 0, s.shard_offset, s.length), hyper, grad_scale, skip, opt_.beta1,
                  opt_.beta2, opt_.eps, groups_[s.group].weight_decay);
  }
  if (offloaded_)
    optim::offloaded_adamw_update_(offloaded_, std::move(ranges), ps, gs, hyper, grad_scale, skip,
                                   opt_.beta1, opt_.beta2, opt_.eps);
  // 2. Every rank's updated shard to every rank, in chunks of at most gather_chunk_ elements per
  //    rank, so the gather buffers stay small next to the moments they save.
  //    Stage 3 gathers nothing here: a unit's parameters are gathered when it next runs.
  const int world = group_->size();
  if (world == 1 || stage_ == 3) return;
  const int64_t chunk = std::min<int64_t>(shard_, gather_chunk_);
  const MemoryUseScope comm(MemoryUse::kComm);
  const Device device = groups_[0].params[0].device();
  Tensor send = zeros({chunk}, DType::kF32, device),
         all = zeros({chunk * world}, DType::kF32, device);
  for (int64_t c0 = 0; c0 < shard_; c0 += chunk) {
    const int64_t len = std::min(chunk, shard_ - c0);
    copy_shard_range(group_->rank(), c0, len, send, 0, /*to_params=*/false);
    all_gather(group_, send, all);
    for (int r = 0; r < world; ++r)
      if (r != group_->rank()) copy_shard_range(r, c0, len, all, r * chunk, /*to_params=*/true);
  }
}

void ZeroAdamW::gather_masters(const MasterFn& fn) {
  if (!masters_) return;
  MasterGather gather(*this);
  std::exception_ptr failure;
  try {
    offloaded_->read(
        [&](const optim::StateChunk& c) { gather.round(c.master, c.first, c.count, fn); });
  } catch (...) {
    failure = std::current_exception();
    if (gather.failed()) throw;  // the collective itself: no further one would complete
    gather.finish();
  }
  // Whether every rank's stream held: rank 0 must not take another rank's missing rounds (zeros)
  // for its masters, and every rank fails alike.
  Tensor failed = full({1}, failure ? 1.0f : 0.0f);
  group_->all_reduce(failed, ReduceOp::kSum)->wait();
  if (failure) std::rethrow_exception(failure);
  if (const float n = failed.to_vector<float>()[0]; n != 0.0f)
    throw std::runtime_error(fmt::format(
        "ZeRO: gathering the master weights failed on {} other rank(s) (each names its file)", n));
}

MasterGather::MasterGather(const ZeroAdamW& opt) : opt_(opt) {
  if (!opt.offloaded() || opt.offloaded()->on_meta()) return;
  rounds_ = opt.offloaded()->stream().chunks();
  chunk_ = opt.offloaded()->stream().chunk_bytes() / 4;
  const MemoryUseScope comm(MemoryUse::kComm);
  send_ = zeros({chunk_});
  all_ = zeros({chunk_ * opt.process_group()->size()});
}

void MasterGather::round(const float* master, int64_t first, int64_t count,
                         const ZeroAdamW::MasterFn& fn) {
  if (rounds_ == 0) return;
  float* out = send_.device_data<float>();
  std::fill(out, out + chunk_, 0.0f);
  if (count > 0) std::memcpy(out, master, static_cast<size_t>(count) * sizeof(float));
  try {
    opt_.process_group()->all_gather(send_, all_)->wait();
  } catch (...) {
    failed_ = true;
    throw;
  }
  ++done_;
  if (opt_.process_group()->rank() != 0 || !fn) return;
  const float* in = all_.device_data<float>();
  for (int r = 0; r < opt_.process_group()->size(); ++r)
    for (const ZeroAdamW::Segment& s : opt_.segments(r)) {
      if (!opt_.is_master(s.group, s.param)) continue;
      const int64_t a = std::max(first, s.shard_offset);
      const int64_t b = std::min(first + count, s.shard_offset + s.length);
      if (a < b)
        fn(opt_.groups()[s.group].params[s.param], s.begin + (a - s.shard_offset), b - a,
           in + r * chunk_ + (a - first));
    }
}

void MasterGather::finish() {
  if (failed_) return;
  try {
    while (done_ < rounds_) round(nullptr, 0, 0, {});
  } catch (...) {
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
    if (p.dtype() != x.dtype()) {  // a working copy: widened on the wire, exactly
      Backend& be = backend_for(p.device());
      if (to_params)
        be.convert(x.device_ptr(), x.dtype(), p.device_ptr(), p.dtype(), e - b);
      else
        be.convert(p.device_ptr(), p.dtype(), x.device_ptr(), x.dtype(), e - b);
    } else if (to_params) {
      assign_(p, x);  // dispatched: a captured step repeats the copies
    } else {
      assign_(x, p);
    }
  }
}

}  // namespace kuai::dist
