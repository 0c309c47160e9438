// Adam's two moments over a flat state of n floats, kept in two files and streamed through memory
// chunk by chunk (io/chunk_stream.h): the part of an offloaded optimizer that does not depend on
// how the parameters map onto the flat state (OffloadedAdamW: every parameter; ZeroAdamW: this
// rank's shard). With `masters`, a third file over the same flat layout holds fp32 master weights
// (train.offload_master: the parameters themselves are kept in the compute dtype). The files are
// scratch: made empty (zero moments) here, removed by the destructor; a checkpoint streams the
// state out (read) and a resume back in (write).
//
// On the meta device (`kuai plan`) there are no files: the chunk buffers are allocated as meta
// optimizer memory, so the plan counts what stays resident, and nothing is read or written.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kuai/core/tensor.h"
#include "kuai/io/chunk_stream.h"

namespace kuai::optim {

struct OffloadOptions {
  std::string dir;  // created if missing; holds exp_avg.bin, exp_avg_sq.bin (and master.bin)
  int64_t chunk_bytes = int64_t{64} << 20;  // per file and buffer
  // train.offload_master: the parameters whose fp32 masters move to disk too (OffloadedAdamW
  // keeps these parameters in master_dtype, bf16 or fp16, from then on). Empty: none.
  std::vector<Tensor> master_params{};
  DType master_dtype = DType::kBF16;
};

// One chunk of the flat state: elements [first, first + count) of each file's array.
struct StateChunk {
  int64_t first = 0, count = 0;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* master = nullptr;  // null without a masters file
};

class OffloadedMoments {
 public:
  OffloadedMoments(const OffloadOptions& options, int64_t elements, bool masters = false);
  ~OffloadedMoments();  // removes the files
  OffloadedMoments(const OffloadedMoments&) = delete;
  OffloadedMoments& operator=(const OffloadedMoments&) = delete;

  int64_t elements() const { return elements_; }
  const std::string& dir() const { return dir_; }
  bool on_meta() const { return !stream_; }
  io::ChunkStream& stream() { return *stream_; }
  const io::ChunkStream& stream() const { return *stream_; }
  bool has_masters() const { return masters_; }
  int64_t files() const { return masters_ ? 3 : 2; }
  // The resident bytes: three chunk buffers per file.
  int64_t buffer_bytes() const { return buffer_bytes_; }
  // Bytes one update pass reads and writes: every file, whole.
  int64_t file_bytes() const { return files() * elements_ * static_cast<int64_t>(sizeof(float)); }

  // fn(chunk) for the state elements chunk by chunk in order.
  using Chunk = std::function<void(const StateChunk&)>;
  void update(const Chunk& fn);  // read, fn, write back
  void read(const Chunk& fn);    // read only (what fn writes is not kept)
  void write(const Chunk& fn);   // fn fills zeroed buffers, which are written (a restore)

 private:
  void pass(const Chunk& fn, bool read, bool write);
  int64_t elements_;
  bool masters_;
  std::string dir_;
  std::unique_ptr<io::ChunkStream> stream_;  // null on meta
  Tensor meta_buffers_;                      // on meta: what the buffers would hold
  int64_t buffer_bytes_ = 0;
};

}  // namespace kuai::optim
