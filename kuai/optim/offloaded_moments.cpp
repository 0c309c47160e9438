// Adam's moments in files, streamed (see offloaded_moments.h).
#include "kuai/optim/offloaded_moments.h"

#include <fmt/format.h>

#include <filesystem>
#include <stdexcept>

#include "kuai/core/allocator.h"
#include "kuai/core/device.h"

namespace kuai::optim {

OffloadedMoments::OffloadedMoments(const OffloadOptions& options, int64_t elements, bool masters)
    : elements_(elements), masters_(masters), dir_(options.dir) {
  if (options.chunk_bytes < 4096)
    throw std::invalid_argument(fmt::format(
        "offload: chunk of {} bytes; at least 4096 (one O_DIRECT block)", options.chunk_bytes));
  if (default_device() == kMeta) {  // planned, not run: the buffers' memory and no files
    const int64_t chunk = (options.chunk_bytes + 4095) / 4096 * 4096;
    const int64_t bytes =
        std::min(chunk, std::max<int64_t>((elements * 4 + 4095) / 4096 * 4096, 4096));
    const MemoryUseScope state(MemoryUse::kOptimizer);
    buffer_bytes_ = 3 * files() * bytes;
    meta_buffers_ = Tensor::empty({buffer_bytes_ / 4}, DType::kF32, kMeta);
    return;
  }
  if (dir_.empty()) throw std::invalid_argument("offload: no directory for the optimizer state");
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec)
    throw io::IoError(fmt::format("offload: {}: cannot create the folder: {}", dir_, ec.message()));
  io::StreamOptions so;
  so.chunk_bytes = options.chunk_bytes;
  const std::filesystem::path d(dir_);
  std::vector<std::string> paths = {(d / "exp_avg.bin").string(), (d / "exp_avg_sq.bin").string()};
  if (masters_) paths.push_back((d / "master.bin").string());
  stream_ =
      std::make_unique<io::ChunkStream>(std::move(paths), std::max<int64_t>(elements_, 1) * 4, so);
  buffer_bytes_ = stream_->buffer_bytes();
}

OffloadedMoments::~OffloadedMoments() {
  if (!stream_) return;
  std::vector<std::string> files;
  for (int64_t f = 0; f < stream_->files(); ++f) files.push_back(stream_->path(f));
  stream_.reset();
  std::error_code ec;
  for (const std::string& f : files) std::filesystem::remove(f, ec);
}

void OffloadedMoments::pass(const Chunk& fn, bool read, bool write) {
  if (!stream_) return;
  const int64_t per_chunk = stream_->chunk_bytes() / 4;
  auto each = [&](int64_t chunk, std::span<std::byte* const> bufs) {
    const int64_t first = chunk * per_chunk;
    const int64_t count = std::min(stream_->chunk_length(chunk) / 4, elements_ - first);
    if (count > 0)
      fn(StateChunk{first, count, reinterpret_cast<float*>(bufs[0]),
                    reinterpret_cast<float*>(bufs[1]),
                    masters_ ? reinterpret_cast<float*>(bufs[2]) : nullptr});
  };
  if (!read)
    stream_->fill(each);
  else
    stream_->pass(each, write);
}

void OffloadedMoments::update(const Chunk& fn) { pass(fn, true, true); }

void OffloadedMoments::read(const Chunk& fn) { pass(fn, true, false); }

void OffloadedMoments::write(const Chunk& fn) { pass(fn, false, true); }

}  // namespace kuai::optim
