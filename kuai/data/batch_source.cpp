// Batch sources: random training windows, sequential evaluation windows and synthetic tokens
// (see batch_source.h for how each keys its random draws).
#include "kuai/data/batch_source.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "kuai/core/rng.h"

namespace kuai::data {
namespace {

void check_rank(const char* what, int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw std::invalid_argument(
        fmt::format("{}: rank {} is not in [0, world_size = {})", what, rank, world_size));
}

void check_index(const char* what, int64_t index) {
  if (index < 0) throw std::out_of_range(fmt::format("{}: batch index {} < 0", what, index));
}

void check_range(const char* what, const TokenFile& file, int64_t begin, int64_t end) {
  if (begin < 0 || end > file.size() || begin >= end)
    throw std::out_of_range(fmt::format("{}: {}: range [{}, {}) is not inside the {} tokens", what,
                                        file.path(), begin, end, file.size()));
}

// Which global draw slot batch `index` of `rank` takes: distinct for distinct (index, rank).
uint64_t draw_slot(int64_t index, int rank, int world_size) {
  return static_cast<uint64_t>(index) * static_cast<uint64_t>(world_size) +
         static_cast<uint64_t>(rank);
}

}  // namespace

BatchSource::BatchSource(int64_t batch_size, int64_t seq_len)
    : batch_size_(batch_size), seq_len_(seq_len) {
  if (batch_size < 1 || seq_len < 1)
    throw std::invalid_argument(fmt::format(
        "BatchSource: batch size {} and sequence length {} must be >= 1", batch_size, seq_len));
}

BatchSource::~BatchSource() = default;

// ---- RandomWindows ----

RandomWindows::RandomWindows(std::shared_ptr<const TokenFile> file, int64_t begin, int64_t end,
                             int64_t batch_size, int64_t seq_len, uint64_t seed, int rank,
                             int world_size)
    : BatchSource(batch_size, seq_len),
      file_(std::move(file)),
      begin_(begin),
      end_(end),
      seed_(seed),
      rank_(rank),
      world_size_(world_size) {
  if (!file_) throw std::invalid_argument("RandomWindows: no token file");
  check_rank("RandomWindows", rank, world_size);
  check_range("RandomWindows", *file_, begin, end);
  if (end - begin < seq_len + 2)
    throw std::invalid_argument(fmt::format(
        "RandomWindows: {}: range [{}, {}) holds {} tokens, fewer than seq_len + 2 = {}",
        file_->path(), begin, end, end - begin, seq_len + 2));
}

void RandomWindows::fill(int64_t index, int32_t* x, int32_t* y) const {
  check_index("RandomWindows", index);
  const int64_t B = batch_size(), T = seq_len();
  // Starts in [begin, end - T - 1]: `range` candidates.
  const uint64_t range = static_cast<uint64_t>(end_ - T - begin_);
  const uint64_t blocks = static_cast<uint64_t>((B + 1) / 2);
  const uint64_t base = draw_slot(index, rank_, world_size_) * blocks;
  for (int64_t b = 0; b < B; b += 2) {
    const auto r = philox4x32(seed_, base + static_cast<uint64_t>(b / 2), kStream);
    for (int64_t j = 0; j < 2 && b + j < B; ++j) {
      const uint64_t u = (static_cast<uint64_t>(r[2 * j]) << 32) | r[2 * j + 1];
      const auto pick =
          static_cast<uint64_t>((static_cast<unsigned __int128>(u) * range) >> 64);  // [0, range)
      const int64_t start = begin_ + static_cast<int64_t>(pick);
      file_->read(start, T, x + (b + j) * T);
      file_->read(start + 1, T, y + (b + j) * T);
    }
  }
}

// ---- SequentialWindows ----

SequentialWindows::SequentialWindows(std::shared_ptr<const TokenFile> file, int64_t begin,
                                     int64_t end, int64_t batch_size, int64_t seq_len, int rank,
                                     int world_size)
    : BatchSource(batch_size, seq_len),
      file_(std::move(file)),
      begin_(begin),
      rank_(rank),
      world_size_(world_size) {
  if (!file_) throw std::invalid_argument("SequentialWindows: no token file");
  check_rank("SequentialWindows", rank, world_size);
  check_range("SequentialWindows", *file_, begin, end);
  num_windows_ = (end - begin - 1) / seq_len;
  if (num_windows_ < 1)
    throw std::invalid_argument(fmt::format(
        "SequentialWindows: {}: range [{}, {}) holds {} tokens, fewer than seq_len + 1 = {}",
        file_->path(), begin, end, end - begin, seq_len + 1));
}

void SequentialWindows::fill(int64_t index, int32_t* x, int32_t* y) const {
  check_index("SequentialWindows", index);
  const int64_t B = batch_size(), T = seq_len();
  const uint64_t n = static_cast<uint64_t>(num_windows_);
  // First window of this batch (128-bit product: no overflow for any index).
  const auto first = static_cast<uint64_t>(
      static_cast<unsigned __int128>(draw_slot(index, rank_, world_size_)) * B % n);
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t window = (first + static_cast<uint64_t>(b)) % n;
    const int64_t start = begin_ + static_cast<int64_t>(window) * T;
    file_->read(start, T, x + b * T);
    file_->read(start + 1, T, y + b * T);
  }
}

// ---- SyntheticTokens ----

SyntheticTokens::SyntheticTokens(int64_t vocab_size, int64_t batch_size, int64_t seq_len,
                                 uint64_t seed, int rank, int world_size)
    : BatchSource(batch_size, seq_len),
      vocab_size_(vocab_size),
      seed_(seed),
      rank_(rank),
      world_size_(world_size) {
  check_rank("SyntheticTokens", rank, world_size);
  if (vocab_size < 1 || vocab_size > std::numeric_limits<int32_t>::max())
    throw std::invalid_argument(fmt::format("SyntheticTokens: vocab size {} is not in [1, {}]",
                                            vocab_size, std::numeric_limits<int32_t>::max()));
}

void SyntheticTokens::fill(int64_t index, int32_t* x, int32_t* y) const {
  check_index("SyntheticTokens", index);
  const int64_t n = batch_size() * seq_len();
  const uint64_t blocks = static_cast<uint64_t>((n + 3) / 4);
  Generator gen(seed_, kStream);
  // Chunks of a multiple of 4 elements advance the offset exactly as one call would, and stay
  // under Generator's OpenMP threshold: fill() runs on loader workers, which must not start
  // OpenMP teams of their own on cores the compute threads use.
  constexpr int64_t kChunk = int64_t{1} << 16;
  const auto draw = [&](int32_t* out, uint64_t offset) {
    gen.set_offset(offset);
    for (int64_t i = 0; i < n; i += kChunk)
      gen.randint(out + i, std::min(kChunk, n - i), 0, static_cast<int32_t>(vocab_size_));
  };
  const uint64_t base = draw_slot(index, rank_, world_size_) * 2 * blocks;
  draw(x, base);
  draw(y, base + blocks);
}

}  // namespace kuai::data
