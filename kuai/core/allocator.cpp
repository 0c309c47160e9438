// The tracking caching allocator, one state per device type over its backend's raw memory
// (core/backend.h): 64-byte aligned blocks, sizes rounded to
// 64 B below 1 MiB and 64 KiB above, one mutex. Freed blocks go to a free list ordered by
// capacity; a request takes the smallest cached block that holds it and is at most 1.25x its
// size (best fit), so gradient buffers freed by zero_grad serve the next forward's activations
// instead of sitting idle beside fresh memory. The bound was 2x: with mixed precision, bf16
// activations then landed in the blocks of fp32 temporaries of twice their size and the peak
// counted the waste (a tiny GPT's bf16 forward held 313 MiB where its tensors needed ~180).
// `current` and `peak` count the capacity of the blocks in use. No transparent-huge-page advice:
// measured on this VM, first touch of madvised 2 MiB pages ran at 0.3 GB/s against 1.2 GB/s for 4
// KiB pages (a 4x slower first step) with no steady-state gain.
#include "kuai/core/allocator.h"

#include "kuai/core/backend.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <unordered_map>

namespace kuai {
namespace {

constexpr size_t kAlign = 64;
constexpr size_t kLargeThreshold = size_t{1} << 20;
constexpr size_t kLargeGranule = size_t{1} << 16;

struct State {
  std::mutex mu;
  MemoryStats stats;
  std::multimap<size_t, void*> free_blocks;    // capacity -> block
  std::unordered_map<void*, size_t> capacity;  // every block we own, in use or not
};

// One state per device type, each over its backend's raw memory (core/backend.h). Never
// destroyed: tensors may outlive static destructors.
State& state_for(Device d) {
  static State* states = new State[kDeviceTypes];
  if (!backend_available(d.type))
    throw std::runtime_error("allocator: device " + d.str() + " has no backend in this build");
  return states[static_cast<size_t>(d.type)];
}

}  // namespace

Allocator& Allocator::get() {
  static Allocator a;
  return a;
}

size_t Allocator::round_size(size_t n) {
  if (n == 0) n = 1;
  if (n < kLargeThreshold) return (n + kAlign - 1) / kAlign * kAlign;
  return (n + kLargeGranule - 1) / kLargeGranule * kLargeGranule;
}

namespace {
thread_local int64_t t_allocations = 0;
thread_local MemoryUse t_use = MemoryUse::kOther;
std::atomic<AllocationObserver*> g_observer{nullptr};
}  // namespace

const char* memory_use_name(MemoryUse u) {
  switch (u) {
    case MemoryUse::kOther:
      return "other";
    case MemoryUse::kParameters:
      return "parameters (fp32 master weights)";
    case MemoryUse::kGradients:
      return "gradients";
    case MemoryUse::kOptimizer:
      return "optimizer state (AdamW moments)";
    case MemoryUse::kWeightCasts:
      return "low-precision weight copies";
    case MemoryUse::kActivations:
      return "activations saved for backward";
    case MemoryUse::kActGrads:
      return "activation gradients in flight";
    case MemoryUse::kComm:
      return "communication buffers";
    case MemoryUse::kWorkspace:
      return "kernel workspace";
    case MemoryUse::kData:
      return "batches";
    case MemoryUse::kArena:
      return "compiled step's arena (activations, their gradients, scratch)";
    case MemoryUse::kCaptured:
      return "values recorded by a capture on meta";
    case MemoryUse::kCount:
      break;
  }
  return "?";
}

MemoryUseScope::MemoryUseScope(MemoryUse use) : saved_(t_use) { t_use = use; }
MemoryUseScope::~MemoryUseScope() { t_use = saved_; }
MemoryUse MemoryUseScope::current() { return t_use; }

void set_allocation_observer(AllocationObserver* observer) { g_observer.store(observer); }

void mark_memory_use(void* block, Device device, MemoryUse use) {
  if (AllocationObserver* o = g_observer.load(std::memory_order_relaxed); o && block)
    o->on_use(block, device, use);
}

int64_t Allocator::allocations_this_thread() { return t_allocations; }

void* Allocator::allocate(size_t nbytes, Device device) {
  State& s = state_for(device);
  ++t_allocations;
  const size_t size = round_size(nbytes);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stats.num_allocs++;
    auto it = s.free_blocks.lower_bound(size);
    if (it != s.free_blocks.end() && it->first <= size + size / 4) {
      void* p = it->second;
      s.stats.current += static_cast<int64_t>(it->first);
      s.stats.peak = std::max(s.stats.peak, s.stats.current);
      s.stats.cache_hits++;
      const size_t cap = it->first;
      s.free_blocks.erase(it);
      if (AllocationObserver* o = g_observer.load(std::memory_order_relaxed))
        o->on_allocate(p, static_cast<int64_t>(cap), device, t_use);
      return p;
    }
  }
  Backend& backend = backend_for(device);
  void* p = backend.allocate(size);
  if (p == nullptr) {
    empty_cache(device);  // give cached blocks back and try once more
    p = backend.allocate(size);
    if (p == nullptr) throw std::bad_alloc();
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.capacity[p] = size;
    s.stats.reserved += static_cast<int64_t>(size);
    s.stats.current += static_cast<int64_t>(size);
    s.stats.peak = std::max(s.stats.peak, s.stats.current);
  }
  if (AllocationObserver* o = g_observer.load(std::memory_order_relaxed))
    o->on_allocate(p, static_cast<int64_t>(size), device, t_use);
  return p;
}

void Allocator::deallocate(void* ptr, size_t nbytes, Device device) {
  if (ptr == nullptr) return;
  State& s = state_for(device);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const size_t cap = s.capacity.at(ptr);
    s.stats.current -= static_cast<int64_t>(cap);
    s.free_blocks.emplace(cap, ptr);
  }
  if (AllocationObserver* o = g_observer.load(std::memory_order_relaxed)) o->on_free(ptr, device);
}

MemoryStats Allocator::stats(Device device) const {
  State& s = state_for(device);
  std::lock_guard<std::mutex> lock(s.mu);
  return s.stats;
}

void Allocator::reset_peak(Device device) {
  State& s = state_for(device);
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.peak = s.stats.current;
}

void Allocator::empty_cache(Device device) {
  State& s = state_for(device);
  Backend& backend = backend_for(device);
  std::lock_guard<std::mutex> lock(s.mu);
  for (const auto& [cap, p] : s.free_blocks) {
    backend.deallocate(p, cap);
    s.capacity.erase(p);
    s.stats.reserved -= static_cast<int64_t>(cap);
  }
  s.free_blocks.clear();
#ifdef __GLIBC__
  // glibc keeps freed heap chunks (below its mmap threshold, which rises to 32 MiB after large
  // frees) resident; trimming hands them back, so the resident set drops with the cache.
  malloc_trim(0);
#endif
}

namespace {

// This thread's scratch: the lent region (if any), and the bytes held at once.
struct ThreadScratch {
  char* base = nullptr;
  size_t size = 0, used = 0;
  int64_t current = 0, peak = 0;
};
thread_local ThreadScratch t_scratch;

size_t scratch_round(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

ScratchBytes::ScratchBytes(size_t bytes, Device device)
    : bytes_(bytes), data_(nullptr), device_(device) {
  if (bytes_ == 0) return;
  ThreadScratch& t = t_scratch;
  const size_t need = scratch_round(bytes_);
  t.current += static_cast<int64_t>(need);
  t.peak = std::max(t.peak, t.current);
  if (t.base != nullptr && t.used + need <= t.size) {
    data_ = t.base + t.used;
    t.used += need;
    lent_ = true;
    return;
  }
  const MemoryUseScope workspace(MemoryUse::kWorkspace);
  data_ = Allocator::get().allocate(bytes_, device_);
}

ScratchBytes::~ScratchBytes() {
  if (data_ == nullptr) return;
  ThreadScratch& t = t_scratch;
  const size_t need = scratch_round(bytes_);
  t.current -= static_cast<int64_t>(need);
  if (!lent_) {
    Allocator::get().deallocate(data_, bytes_, device_);
    return;
  }
  // Lent bytes are a stack; one freed out of order is reclaimed when the region ends.
  if (static_cast<char*>(data_) + need == t.base + t.used) t.used -= need;
}

ScratchRegion::ScratchRegion(void* base, size_t bytes)
    : saved_base_(t_scratch.base), saved_size_(t_scratch.size), saved_used_(t_scratch.used) {
  t_scratch.base = static_cast<char*>(base);
  t_scratch.size = bytes;
  t_scratch.used = 0;
}

ScratchRegion::~ScratchRegion() {
  t_scratch.base = saved_base_;
  t_scratch.size = saved_size_;
  t_scratch.used = saved_used_;
}

int64_t ScratchRegion::peak() { return t_scratch.peak; }
void ScratchRegion::reset_peak() { t_scratch.peak = t_scratch.current; }

}  // namespace kuai
