// The tracking, caching allocator every tensor byte comes from. It accounts, per device, the
// bytes handed out to live tensors (current and peak, with reset_peak) and the bytes it holds in
// total (reserved = live + cached). Freed blocks are cached by size class and reused, so a
// training step that allocates the same sizes every time costs no system calls and no page
// faults after the first step. Every memory claim in kuai is measured through these counters.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kuai/core/device.h"

namespace kuai {

struct MemoryStats {
  int64_t current = 0;   // capacity of the blocks held by live tensors
  int64_t peak = 0;      // max of current since the last reset_peak
  int64_t reserved = 0;  // current + cached free blocks
  int64_t num_allocs = 0;
  int64_t cache_hits = 0;
};

class Allocator {
 public:
  static Allocator& get();

  void* allocate(size_t nbytes, Device device = kCPU);
  void deallocate(void* ptr, size_t nbytes, Device device = kCPU);

  MemoryStats stats(Device device = kCPU) const;
  void reset_peak(Device device = kCPU);
  void empty_cache(Device device = kCPU);  // returns cached blocks to the system

  // Size class a request of nbytes is served from (what `current` counts).
  static size_t round_size(size_t nbytes);
};

// `count` floats of CPU scratch from the tracking allocator (so the memory counters see it),
// returned when the object goes out of scope. For kernels' temporary buffers.
class ScratchFloats {
 public:
  explicit ScratchFloats(int64_t count)
      : bytes_(count > 0 ? static_cast<size_t>(count) * sizeof(float) : 0),
        data_(bytes_ > 0 ? static_cast<float*>(Allocator::get().allocate(bytes_)) : nullptr) {}
  ~ScratchFloats() {
    if (data_ != nullptr) Allocator::get().deallocate(data_, bytes_);
  }
  ScratchFloats(const ScratchFloats&) = delete;
  ScratchFloats& operator=(const ScratchFloats&) = delete;
  float* data() const { return data_; }

 private:
  size_t bytes_;
  float* data_;
};

}  // namespace kuai
