// AdamW with its state offloaded to disk (technique 8's offload): the two moments live in files
// (optim/offloaded_moments.h) laid out as one flat array over the parameters, and each step
// streams them through three chunk buffers per file, reading chunk i+1 while chunk i is updated
// and chunk i-1 is written. The step is one dispatched primitive (optim/offload_update.h) whose
// evaluation runs AdamW's own update over the parameters' and gradients' elements of each chunk,
// so the parameters and moments are those of in-memory AdamW bit for bit (the kernel is
// elementwise), and a compiled step captures and replays it. What stays resident is the chunk
// buffers (2 files x 3 x chunk_bytes), counted as optimizer memory by the allocator.
//
// The files are scratch: made empty (zero moments) when the optimizer is built, removed when it
// is destroyed. A checkpoint copies the state out through read_state() and a resume back in
// through write_state(), one chunk at a time.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kuai/optim/adamw.h"
#include "kuai/optim/offloaded_moments.h"

namespace kuai::optim {

class OffloadedAdamW : public Optimizer {
 public:
  OffloadedAdamW(std::vector<ParamGroup> groups, const AdamWOptions& options,
                 const OffloadOptions& offload);
  ~OffloadedAdamW() override;

  // The flat layout: element e of parameter (group, index) is state element first + e. Each
  // parameter starts on a 64-byte boundary (16 floats), as a tensor of its own would.
  struct Slot {
    size_t group = 0, index = 0;
    int64_t first = 0, numel = 0;
  };
  const std::vector<Slot>& layout() const { return slots_; }
  int64_t state_elements() const { return elements_; }
  io::ChunkStream& stream() { return moments_->stream(); }
  const io::ChunkStream& stream() const { return moments_->stream(); }
  OffloadedMoments& moments() { return *moments_; }
  std::optional<std::vector<Tensor>> capture_state() override { return {{step_, lr_tensor_}}; }

  // Streams the moments out, chunk by chunk: fn(first, count, m, v) for state elements
  // [first, first + count) (padding between parameters included, always 0).
  using ConstChunk =
      std::function<void(int64_t first, int64_t count, const float* m, const float* v)>;
  void read_state(const ConstChunk& fn);
  // Writes the moments in, chunk by chunk: fn fills m and v for [first, first + count) (zeroed
  // before the call).
  using MutableChunk = std::function<void(int64_t first, int64_t count, float* m, float* v)>;
  void write_state(const MutableChunk& fn);

 protected:
  void update(const Tensor& grad_scale, const Tensor& skip) override;

 private:
  AdamWOptions opt_;
  std::vector<Slot> slots_;
  int64_t elements_ = 0;
  std::shared_ptr<OffloadedMoments> moments_;
};

}  // namespace kuai::optim
