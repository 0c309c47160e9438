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

// What a block is for, as the engine says where it allocates (MemoryUseScope): one row each of
// `kuai plan`'s memory table. Blocks allocated without a scope are kOther; an observer decides
// what they are from where the step is (forward: activations, backward: their gradients).
enum class MemoryUse : int {
  kOther,
  kParameters,   // the model's (fp32 master) parameters
  kGradients,    // parameter gradients: .grad, DDP's buckets, ZeRO-2's gradient shard
  kOptimizer,    // optimizer state (AdamW's moments, ZeRO's shards of them)
  kWeightCasts,  // autocast's low-precision copies of the parameters, kept for one step
  kActivations,  // op outputs of forward
  kActGrads,     // tensors made during backward
  kComm,         // communication buffers: compression wire copies, error feedback, gathers
  kWorkspace,    // kernels' scratch
  kData,         // input batches
  kArena,        // a compiled step's planned arena (its activations, their gradients, scratch)
  kCaptured,     // values a capture on meta made (compile): they stand for memory the replay
                 // plans in its arena, and are not the step's memory themselves
  kCount
};
const char* memory_use_name(MemoryUse u);

// RAII: blocks this thread allocates while the scope lives are of `use` (the innermost wins).
class MemoryUseScope {
 public:
  explicit MemoryUseScope(MemoryUse use);
  ~MemoryUseScope();
  MemoryUseScope(const MemoryUseScope&) = delete;
  MemoryUseScope& operator=(const MemoryUseScope&) = delete;
  static MemoryUse current();

 private:
  MemoryUse saved_;
};

// Sees every block handed out and given back (the planner's accounting of a step on meta
// tensors). One at a time; set_allocation_observer(nullptr) removes it. Called on the allocating
// thread, outside the allocator's lock; without an observer the allocator pays one load.
class AllocationObserver {
 public:
  virtual ~AllocationObserver() = default;
  virtual void on_allocate(void* block, int64_t capacity, Device device, MemoryUse use) = 0;
  virtual void on_free(void* block, Device device) = 0;
  // The block changed hands (an activation gradient became a parameter's .grad).
  virtual void on_use(void* block, Device device, MemoryUse use) = 0;
};
void set_allocation_observer(AllocationObserver* observer);
// Tells the observer (if any) that the block at `block` is now of `use`.
void mark_memory_use(void* block, Device device, MemoryUse use);

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
  // Requests made by the calling thread, on every device (num_allocs counts every thread's).
  static int64_t allocations_this_thread();
};

// `bytes` of scratch (64-byte aligned) on `device` returned when the object goes out of scope.
// For library workspaces and kernels' temporary buffers. It comes from the region lent to this
// thread (ScratchRegion) while one is lent and has room, else from the tracking allocator (so the
// memory counters see it). Either way it counts in this thread's scratch high-water mark. (The
// meta backend takes its kernels' scratch so too: a compiled step traced on meta lends it the
// same planned bytes.)
class ScratchBytes {
 public:
  explicit ScratchBytes(size_t bytes, Device device = kCPU);
  ~ScratchBytes();
  ScratchBytes(const ScratchBytes&) = delete;
  ScratchBytes& operator=(const ScratchBytes&) = delete;
  void* data() const { return data_; }

 private:
  size_t bytes_;
  void* data_;
  bool lent_ = false;
  Device device_;
};

// Lends [base, base + bytes) to the scratch of the calling thread until destroyed (nesting
// restores the outer region): a compiled step hands each node the bytes its memory plan set
// aside for the node's scratch, so a replay takes no scratch from the allocator. Scratch taken in
// other threads (inside a parallel region) is not served from it.
class ScratchRegion {
 public:
  ScratchRegion(void* base, size_t bytes);
  ~ScratchRegion();
  ScratchRegion(const ScratchRegion&) = delete;
  ScratchRegion& operator=(const ScratchRegion&) = delete;
  // The most scratch bytes this thread held at once since reset_peak (rounded to 64 B each).
  static int64_t peak();
  static void reset_peak();

 private:
  char* saved_base_;
  size_t saved_size_, saved_used_;
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
