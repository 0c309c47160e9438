// AdamW over offloaded state (see offload_adamw.h).
#include "kuai/optim/offload_adamw.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <stdexcept>

#include "kuai/core/ops.h"

namespace kuai::optim {
namespace {
constexpr int64_t kAlignFloats = 16;
}

OffloadedAdamW::OffloadedAdamW(std::vector<ParamGroup> groups, const AdamWOptions& options,
                               const OffloadOptions& offload)
    : Optimizer(std::move(groups)), opt_(options), dir_(offload.dir) {
  set_lr(options.lr);
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (size_t i = 0; i < groups_[gi].params.size(); ++i) {
      const Tensor& p = groups_[gi].params[i];
      if (p.dtype() != DType::kF32 || !p.is_contiguous() || p.device() != kCPU)
        throw std::invalid_argument(
            "offloaded AdamW: parameters must be contiguous float32 tensors on the CPU, got " +
            p.str());
      elements_ = (elements_ + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
      slots_.push_back({gi, i, elements_, p.numel()});
      elements_ += p.numel();
    }
  if (dir_.empty()) throw std::invalid_argument("offloaded AdamW: no directory for its state");
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec)
    throw io::IoError(fmt::format("offload: {}: cannot create the folder: {}", dir_, ec.message()));
  io::StreamOptions so;
  so.chunk_bytes = offload.chunk_bytes;
  const std::filesystem::path d(dir_);
  stream_ = std::make_unique<io::ChunkStream>(
      std::vector<std::string>{(d / "exp_avg.bin").string(), (d / "exp_avg_sq.bin").string()},
      elements_ * 4, so);
}

OffloadedAdamW::~OffloadedAdamW() {
  std::vector<std::string> files;
  for (int64_t f = 0; f < stream_->files(); ++f) files.push_back(stream_->path(f));
  stream_.reset();
  std::error_code ec;
  for (const std::string& f : files) std::filesystem::remove(f, ec);
}

void OffloadedAdamW::update(const Tensor& grad_scale, const Tensor& skip) {
  advance_step_(step_, skip);
  const Tensor hyper = adamw_hyper(step_, lr_tensor_, opt_.beta1, opt_.beta2);
  const int64_t per_chunk = stream_->chunk_bytes() / 4;
  size_t s0 = 0;  // the first slot that may overlap the chunk (slots are in order)
  stream_->pass([&](int64_t chunk, std::span<std::byte* const> bufs) {
    const int64_t lo = chunk * per_chunk, hi = lo + stream_->chunk_length(chunk) / 4;
    auto* m = reinterpret_cast<float*>(bufs[0]);
    auto* v = reinterpret_cast<float*>(bufs[1]);
    while (s0 < slots_.size() && slots_[s0].first + slots_[s0].numel <= lo) ++s0;
    for (size_t s = s0; s < slots_.size() && slots_[s].first < hi; ++s) {
      const Slot& slot = slots_[s];
      const ParamGroup& group = groups_[slot.group];
      const Tensor& p = group.params[slot.index];
      const Tensor g = p.grad();
      if (!g.defined()) continue;
      const int64_t a = std::max(lo, slot.first), b = std::min(hi, slot.first + slot.numel);
      const int64_t off = a - slot.first, len = b - a;
      const Tensor pf = narrow(reshape(p, {slot.numel}), 0, off, len);
      const Tensor gf = narrow(reshape(g.contiguous(), {slot.numel}), 0, off, len);
      adamw_update_(pf, gf, Tensor::borrow(m + (a - lo), {len}, DType::kF32),
                    Tensor::borrow(v + (a - lo), {len}, DType::kF32), hyper, grad_scale, skip,
                    opt_.beta1, opt_.beta2, opt_.eps, group.weight_decay);
    }
  });
}

void OffloadedAdamW::read_state(const ConstChunk& fn) {
  const int64_t per_chunk = stream_->chunk_bytes() / 4;
  stream_->pass(
      [&](int64_t chunk, std::span<std::byte* const> bufs) {
        fn(chunk * per_chunk, stream_->chunk_length(chunk) / 4,
           reinterpret_cast<const float*>(bufs[0]), reinterpret_cast<const float*>(bufs[1]));
      },
      /*write=*/false);
}

void OffloadedAdamW::write_state(const MutableChunk& fn) {
  const int64_t per_chunk = stream_->chunk_bytes() / 4;
  stream_->fill([&](int64_t chunk, std::span<std::byte* const> bufs) {
    fn(chunk * per_chunk, stream_->chunk_length(chunk) / 4, reinterpret_cast<float*>(bufs[0]),
       reinterpret_cast<float*>(bufs[1]));
  });
}

}  // namespace kuai::optim
