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

// `bytes` of CPU scratch from the tracking allocator (64-byte aligned, counted by the memory
// counters), returned when the object goes out of scope. For library workspaces.
class ScratchBytes {
 public:
  explicit ScratchBytes(size_t bytes)
      : bytes_(bytes), data_(bytes_ > 0 ? Allocator::get().allocate(bytes_) : nullptr) {}
  ~ScratchBytes() {
    if (data_ != nullptr) Allocator::get().deallocate(data_, bytes_);
  }
  ScratchBytes(const ScratchBytes&) = delete;
  ScratchBytes& operator=(const ScratchBytes&) = delete;
  void* data() const { return data_; }

 private:
  size_t bytes_;
  void* data_;
};

// `count` floats of CPU scratch from the tracking allocator (so the memory counters see it),
// returned when the object goes out of scope. For kernels' temporary buffers.
class ScratchFloats : ScratchBytes {
 public:
  explicit ScratchFloats(int64_t count)
      : ScratchBytes(count > 0 ? static_cast<size_t>(count) * sizeof(float) : 0) {}
  float* data() const { return static_cast<float*>(ScratchBytes::data()); }
};

}  // namespace kuai
