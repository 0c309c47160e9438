// ZeRO stage 1 (see zero.h).
#include "kuai/dist/zero.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "kuai/backend/cpu/kernels.h"
#include "kuai/core/ops.h"

namespace kuai::dist {

ZeroAdamW::ZeroAdamW(std::vector<optim::ParamGroup> groups, const optim::AdamWOptions& options,
                     std::shared_ptr<ProcessGroup> group, int64_t gather_chunk)
    : Optimizer(std::move(groups)),
      opt_(options),
      group_(std::move(group)),
      gather_chunk_(std::max<int64_t>(1, gather_chunk)) {
  lr_ = options.lr;
  for (const optim::ParamGroup& g : groups_)
    for (const Tensor& p : g.params) {
      if (p.dtype() != DType::kF32 || !p.is_contiguous())
        throw std::invalid_argument("ZeroAdamW: parameters must be contiguous fp32");
      total_ += p.numel();
    }
  const int64_t world = group_->size();
  shard_ = (total_ + world - 1) / world;
  mine_ = segments_of(group_->rank());
  m_ = zeros({std::max<int64_t>(shard_, 1)});
  v_ = zeros({std::max<int64_t>(shard_, 1)});
}

std::vector<ZeroAdamW::Segment> ZeroAdamW::segments_of(int rank) const {
  const int64_t lo = rank * shard_, hi = std::min(total_, lo + shard_);
  std::vector<Segment> out;
  int64_t at = 0;  // flat index of the current parameter's first element
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (size_t i = 0; i < groups_[gi].params.size(); ++i) {
      const int64_t n = groups_[gi].params[i].numel();
      const int64_t b = std::max(lo, at), e = std::min(hi, at + n);
      if (b < e) out.push_back({gi, i, b - at, e - b, b - lo});
      at += n;
    }
  return out;
}

void ZeroAdamW::step(float grad_scale) {
  ++step_;
  cpu::AdamWParams hp = adamw_params(opt_, lr_, step_, grad_scale);
  // 1. Update this rank's shard.
  for (const Segment& s : mine_) {
    Tensor& p = groups_[s.group].params[s.param];
    const Tensor g = p.grad();
    if (!g.defined()) throw std::runtime_error("ZeroAdamW: a parameter has no gradient");
    const Tensor gc = g.contiguous();
    hp.weight_decay = groups_[s.group].weight_decay;
    cpu::adamw_step(p.data<float>() + s.begin, gc.data<float>() + s.begin,
                    m_.data<float>() + s.shard_offset, v_.data<float>() + s.shard_offset, s.length,
                    hp);
  }
  // 2. Every rank's updated shard to every rank, in chunks of at most gather_chunk_ elements per
  //    rank, so the gather buffers stay small next to the moments they save.
  const int world = group_->size();
  if (world == 1) return;
  const int64_t chunk = std::min<int64_t>(shard_, gather_chunk_);
  Tensor send = zeros({chunk}), all = zeros({chunk * world});
  for (int64_t c0 = 0; c0 < shard_; c0 += chunk) {
    const int64_t len = std::min(chunk, shard_ - c0);
    copy_shard_range(group_->rank(), c0, len, send.data<float>(), /*to_params=*/false);
    group_->all_gather(send, all)->wait();
    for (int r = 0; r < world; ++r)
      if (r != group_->rank())
        copy_shard_range(r, c0, len, all.data<float>() + r * chunk, /*to_params=*/true);
  }
}

void ZeroAdamW::copy_shard_range(int rank, int64_t begin, int64_t length, float* buf,
                                 bool to_params) {
  for (const Segment& s : rank == group_->rank() ? mine_ : segments_of(rank)) {
    const int64_t b = std::max(begin, s.shard_offset);
    const int64_t e = std::min(begin + length, s.shard_offset + s.length);
    if (b >= e) continue;
    float* p = groups_[s.group].params[s.param].data<float>() + s.begin + (b - s.shard_offset);
    float* x = buf + (b - begin);
    if (to_params)
      std::memcpy(p, x, static_cast<size_t>(e - b) * sizeof(float));
    else
      std::memcpy(x, p, static_cast<size_t>(e - b) * sizeof(float));
  }
}

}  // namespace kuai::dist
