// Adam's two moments over a flat state of n floats, kept in two files and streamed through memory
// chunk by chunk (io/chunk_stream.h): the part of an offloaded optimizer that does not depend on
// how the parameters map onto the flat state (OffloadedAdamW: every parameter; ZeroAdamW: this
// rank's shard). The files are scratch: made empty (zero moments) here, removed by the destructor;
// a checkpoint streams the state out (read) and a resume back in (write).
//
// On the meta device (`kuai plan`) there are no files: the chunk buffers are allocated as meta
// optimizer memory, so the plan counts what stays resident, and nothing is read or written.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kuai/core/tensor.h"
#include "kuai/io/chunk_stream.h"

namespace kuai::optim {

struct OffloadOptions {
  std::string dir;                          // created if missing; holds exp_avg.bin, exp_avg_sq.bin
  int64_t chunk_bytes = int64_t{64} << 20;  // per file and buffer
};

class OffloadedMoments {
 public:
  OffloadedMoments(const OffloadOptions& options, int64_t elements);
  ~OffloadedMoments();  // removes the files
  OffloadedMoments(const OffloadedMoments&) = delete;
  OffloadedMoments& operator=(const OffloadedMoments&) = delete;

  int64_t elements() const { return elements_; }
  const std::string& dir() const { return dir_; }
  bool on_meta() const { return !stream_; }
  io::ChunkStream& stream() { return *stream_; }
  const io::ChunkStream& stream() const { return *stream_; }
  // The resident bytes: six chunk buffers.
  int64_t buffer_bytes() const { return buffer_bytes_; }
  // Bytes one update pass reads and writes: both files, whole.
  int64_t file_bytes() const { return 2 * elements_ * static_cast<int64_t>(sizeof(float)); }

  // fn(first, count, m, v) for the state elements [first, first + count), chunk by chunk in order.
  using Chunk = std::function<void(int64_t first, int64_t count, float* m, float* v)>;
  using ConstChunk =
      std::function<void(int64_t first, int64_t count, const float* m, const float* v)>;
  void update(const Chunk& fn);     // read, fn, write back
  void read(const ConstChunk& fn);  // read only
  void write(const Chunk& fn);      // fn fills zeroed buffers, which are written (a restore)

 private:
  void pass(const Chunk& fn, bool read, bool write);
  int64_t elements_;
  std::string dir_;
  std::unique_ptr<io::ChunkStream> stream_;  // null on meta
  Tensor meta_buffers_;                      // on meta: what the buffers would hold
  int64_t buffer_bytes_ = 0;
};

}  // namespace kuai::optim
