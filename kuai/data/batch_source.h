// What goes into a training batch. A BatchSource fills batch `index` into caller-owned (B, T)
// int32 buffers: x holds the inputs and y the targets (x shifted by one token). The contents are
// a pure function of (seed, rank, world size, index) and never of timing or of which thread
// asks, so the DataLoader can fill batches on any worker in any order and still deliver the same
// bits; fill() is const and thread-safe (several workers call it at once).
//
// RandomWindows: training windows at random positions of a token file range.
// SequentialWindows: a fixed held-out sequence of back-to-back windows (evaluation).
// SyntheticTokens: uniform random ids, no file (benchmarks).
#pragma once

#include <cstdint>
#include <memory>

#include "kuai/data/token_file.h"

namespace kuai::data {

class BatchSource {
 public:
  BatchSource(int64_t batch_size, int64_t seq_len);
  virtual ~BatchSource();

  // x, y: (B, T) row-major; y[b, t] is the token after x[b, t]. Thread-safe.
  virtual void fill(int64_t index, int32_t* x, int32_t* y) const = 0;

  int64_t batch_size() const { return batch_size_; }
  int64_t seq_len() const { return seq_len_; }

 private:
  int64_t batch_size_, seq_len_;
};

// B windows of T + 1 tokens whose starts are drawn uniformly from [begin, end - T - 1], so x and
// y both lie inside [begin, end). The draws come from Philox4x32-10 keyed the way Generator keys
// it: key = seed, counter = (block, kRandomWindowsStream). Each block gives four 32-bit words,
// two per row (one 64-bit draw, mapped to the range by a 64x64->128 multiply-shift), so a batch
// uses ceil(B / 2) blocks; batch `index` of `rank` uses blocks starting at
// (index * world_size + rank) * ceil(B / 2). Distinct (index, rank) pairs therefore never share
// a block, and every rank of a run sees a different, fixed stream of windows.
class RandomWindows final : public BatchSource {
 public:
  static constexpr uint64_t kStream = 0x6b75616957696e64ull;  // "kuaiWind"

  RandomWindows(std::shared_ptr<const TokenFile> file, int64_t begin, int64_t end,
                int64_t batch_size, int64_t seq_len, uint64_t seed, int rank = 0,
                int world_size = 1);
  void fill(int64_t index, int32_t* x, int32_t* y) const override;

 private:
  std::shared_ptr<const TokenFile> file_;
  int64_t begin_, end_;
  uint64_t seed_;
  int rank_, world_size_;
};

// Back-to-back windows for evaluation: the range holds n = (end - begin - 1) / T whole windows
// (each needs T + 1 tokens for its targets); batch i, row b of `rank` takes window
// ((i * world_size + rank) * B + b) mod n, which starts at begin + window * T.
class SequentialWindows final : public BatchSource {
 public:
  SequentialWindows(std::shared_ptr<const TokenFile> file, int64_t begin, int64_t end,
                    int64_t batch_size, int64_t seq_len, int rank = 0, int world_size = 1);
  void fill(int64_t index, int32_t* x, int32_t* y) const override;
  int64_t num_windows() const { return num_windows_; }

 private:
  std::shared_ptr<const TokenFile> file_;
  int64_t begin_, num_windows_;
  int rank_, world_size_;
};

// Uniform random ids in [0, vocab_size) for x and y independently (benchmarks: no file, no
// relation between x and y). Generator(seed, kStream); batch `index` of `rank` starts at block
// (index * world_size + rank) * 2 * ceil(B * T / 4): x takes the first ceil(B * T / 4) blocks,
// y the rest.
class SyntheticTokens final : public BatchSource {
 public:
  static constexpr uint64_t kStream = 0x6b75616953796e74ull;  // "kuaiSynt"

  SyntheticTokens(int64_t vocab_size, int64_t batch_size, int64_t seq_len, uint64_t seed,
                  int rank = 0, int world_size = 1);
  void fill(int64_t index, int32_t* x, int32_t* y) const override;
  int64_t vocab_size() const { return vocab_size_; }

 private:
  int64_t vocab_size_;
  uint64_t seed_;
  int rank_, world_size_;
};

}  // namespace kuai::data
